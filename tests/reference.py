"""Pure-Python / float64 references for the reduction kernels (used only by the tests).

- ``python_sum``: element-wise ``math.fsum`` over Python floats (or exact Python ints): the ground truth
  for small tensors, independent of torch's arithmetic.
- ``float64_sum``: the same in torch float64 (exact for our integer sizes), for large tensors; checked
  against ``python_sum`` in the tests.
- ``sequential_sum`` / ``pairwise_sum``: the exact operation order of accumulate_n and tree_reduce in
  the accumulation dtype (float32 for half types), so float results can be compared bit for bit.
"""

from __future__ import annotations

import math

import torch

ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
       torch.float64: torch.float64, torch.int32: torch.int64, torch.int64: torch.int64}


def python_sum(tensors: list[torch.Tensor], scale: float | None = None) -> list[float]:
    """Element-wise exact sum (math.fsum / int) of flattened tensors, times scale, as Python numbers."""
    cols = zip(*(t.reshape(-1).tolist() for t in tensors))
    if tensors[0].dtype.is_floating_point:
        out = [math.fsum(c) for c in cols]
        return [v * scale for v in out] if scale is not None else out
    return [sum(c) for c in cols]


def float64_sum(tensors: list[torch.Tensor], scale: float | None = None) -> torch.Tensor:
    """Element-wise sum in float64 (int64 for integers), times scale, with the inputs' shape."""
    wide = torch.float64 if tensors[0].dtype.is_floating_point else torch.int64
    acc = torch.zeros(tensors[0].shape, dtype=wide)
    for t in tensors:
        acc += t.to(wide)
    return acc * scale if scale is not None else acc


def _finish(acc: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    if scale is not None:
        acc = acc * scale
    return acc.to(dtype)


def sequential_sum(tensors: list[torch.Tensor], scale: float | None = None) -> torch.Tensor:
    """((x0 + x1) + x2) + ... in the accumulation dtype, then scaled and cast: accumulate_n's order."""
    acc_t = ACC[tensors[0].dtype]
    acc = tensors[0].to(acc_t).clone()
    for t in tensors[1:]:
        acc += t.to(acc_t)
    return _finish(acc, tensors[0].dtype, scale)


def pairwise_sum(tensors: list[torch.Tensor], scale: float | None = None) -> torch.Tensor:
    """Balanced pairwise sum (left half = n // 2) in the accumulation dtype: tree_reduce's order."""
    acc_t = ACC[tensors[0].dtype]

    def rec(ts: list[torch.Tensor]) -> torch.Tensor:
        if len(ts) == 1:
            return ts[0].to(acc_t)
        mid = len(ts) // 2
        return rec(ts[:mid]) + rec(ts[mid:])

    return _finish(rec(tensors), tensors[0].dtype, scale)


def tolerance(tensors: list[torch.Tensor], ref: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Error bound of an N-term float sum: N * eps(acc) * sum|x| * |scale| + eps(out) * |ref| (ref scaled)."""
    dtype = tensors[0].dtype
    abs_sum = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for t in tensors:
        abs_sum += t.to(torch.float64).abs()
    eps_acc = torch.finfo(ACC[dtype]).eps
    eps_out = torch.finfo(dtype).eps
    factor = abs(scale) if scale is not None else 1.0
    return len(tensors) * eps_acc * abs_sum * factor + eps_out * ref.abs() + 1e-300


# --- hash_tensors: the definition of csrc/core/hash.h in pure Python ---------------------------------------
_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                           0x27D4EB2F165667C5)
HASH_CHUNK = 4096


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _round(acc: int, word: int) -> int:
    return (_rotl((acc + word * _P2) & _M64, 31) * _P1) & _M64


def xxh64(data: bytes, seed: int) -> int:
    """XXH64 (Yann Collet's reference algorithm) of ``data``."""
    n, p = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _M64, (seed + _P2) & _M64, seed & _M64, (seed - _P1) & _M64]
        while p + 32 <= n:
            for j in range(4):
                v[j] = _round(v[j], int.from_bytes(data[p + 8 * j:p + 8 * j + 8], "little"))
            p += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M64
        for x in v:
            h = (((h ^ _round(0, x)) * _P1) + _P4) & _M64
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    while p + 8 <= n:
        h ^= _round(0, int.from_bytes(data[p:p + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _M64
        p += 8
    if p + 4 <= n:
        h ^= (int.from_bytes(data[p:p + 4], "little") * _P1) & _M64
        h = (_rotl(h, 23) * _P2 + _P3) & _M64
        p += 4
    while p < n:
        h ^= (data[p] * _P5) & _M64
        h = (_rotl(h, 11) * _P1) & _M64
        p += 1
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def hash_bytes(data: bytes) -> int:
    """The hash of ``data`` as hash_tensors defines it, as a signed 64-bit int (the op's int64)."""
    total, level = len(data), 0
    while -(-len(data) // HASH_CHUNK) > 1:
        hs = [xxh64(data[i:i + HASH_CHUNK], (level << 56) + i // HASH_CHUNK) for i in range(0, len(data), HASH_CHUNK)]
        data = b"".join(h.to_bytes(8, "little") for h in hs)
        level += 1
    last = xxh64(data, level << 56).to_bytes(8, "little") if data else b""
    h = xxh64(last, total)
    return h - (1 << 64) if h >= 1 << 63 else h


def tensor_bytes(t: torch.Tensor) -> bytes:
    """``t``'s values in logical (row-major) order as bytes, read element by element through Python."""
    flat = t.resolve_conj().resolve_neg().reshape(-1)
    size = t.element_size()
    out = bytearray()
    for i in range(flat.numel()):
        out += bytes(flat[i:i + 1].clone().view(torch.uint8).tolist())
    assert len(out) == flat.numel() * size
    return bytes(out)
