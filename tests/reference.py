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
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3, _P64_4, _P64_5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                          0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_PMX_1, _PMX_2 = 0x165667919E3779F9, 0x9FB21C651E98DF25
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
HASH_CHUNK = 4096


def _u64(b: bytes, o: int) -> int:
    return int.from_bytes(b[o:o + 8], "little")


def _u32(b: bytes, o: int) -> int:
    return int.from_bytes(b[o:o + 4], "little")


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p ^ (p >> 64)) & _M64


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * _PMX_1) & _M64
    return h ^ (h >> 32)


def _avalanche_xxh64(h: int) -> int:
    h ^= h >> 33
    h = (h * _P64_2) & _M64
    h ^= h >> 29
    h = (h * _P64_3) & _M64
    return h ^ (h >> 32)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _mix16(data: bytes, o: int, secret: bytes, so: int, seed: int) -> int:
    lo = _u64(data, o) ^ ((_u64(secret, so) + seed) & _M64)
    return _fold(lo, _u64(data, o + 8) ^ ((_u64(secret, so + 8) - seed) & _M64))


def xxh3_64(data: bytes, seed: int) -> int:
    """XXH3-64 with a seed (XXH3_64bits_withSeed of Yann Collet's specification) of ``data``."""
    n, s = len(data), _SECRET
    if n == 0:
        return _avalanche_xxh64(seed ^ _u64(s, 56) ^ _u64(s, 64))
    if n <= 3:
        combined = (data[0] << 16) | (data[n >> 1] << 24) | data[n - 1] | (n << 8)
        return _avalanche_xxh64(combined ^ (((_u32(s, 0) ^ _u32(s, 4)) + seed) & _M64))
    if n <= 8:
        low = seed & 0xFFFFFFFF
        swapped = int.from_bytes(low.to_bytes(4, "little"), "big")
        seed ^= swapped << 32
        x = (_u32(data, n - 4) + (_u32(data, 0) << 32)) ^ (((_u64(s, 8) ^ _u64(s, 16)) - seed) & _M64)
        x ^= _rotl(x, 49) ^ _rotl(x, 24)
        x = (x * _PMX_2) & _M64
        x ^= (x >> 35) + n
        x = (x * _PMX_2) & _M64
        return x ^ (x >> 28)
    if n <= 16:
        lo = _u64(data, 0) ^ (((_u64(s, 24) ^ _u64(s, 32)) + seed) & _M64)
        hi = _u64(data, n - 8) ^ (((_u64(s, 40) ^ _u64(s, 48)) - seed) & _M64)
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche((n + swapped + hi + _fold(lo, hi)) & _M64)
    if n <= 128:
        acc = (n * _P64_1) & _M64
        for i in range((n - 1) >> 5, -1, -1):
            acc += _mix16(data, 16 * i, s, 32 * i, seed) + _mix16(data, n - 16 * i - 16, s, 32 * i + 16, seed)
        return _avalanche(acc & _M64)
    if n <= 240:
        acc = (n * _P64_1) & _M64
        for i in range(8):
            acc += _mix16(data, 16 * i, s, 16 * i, seed)
        acc = _avalanche(acc & _M64)
        for i in range(8, n // 16):
            acc += _mix16(data, 16 * i, s, 16 * (i - 8) + 3, seed)
        acc += _mix16(data, n - 16, s, 119, seed)
        return _avalanche(acc & _M64)
    secret = b"".join((((_u64(s, o) + seed) if o % 16 == 0 else (_u64(s, o) - seed)) & _M64).to_bytes(8, "little")
                      for o in range(0, 192, 8))
    acc = [_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1]

    def accumulate(o: int, so: int) -> None:
        for i in range(8):
            v = _u64(data, o + 8 * i)
            k = v ^ _u64(secret, so + 8 * i)
            acc[i ^ 1] = (acc[i ^ 1] + v) & _M64
            acc[i] = (acc[i] + (k & 0xFFFFFFFF) * (k >> 32)) & _M64

    blocks = (n - 1) // 1024
    for b in range(blocks):
        for j in range(16):
            accumulate(1024 * b + 64 * j, 8 * j)
        for i in range(8):
            a = acc[i] ^ (acc[i] >> 47) ^ _u64(secret, 128 + 8 * i)
            acc[i] = (a * _P32_1) & _M64
    for j in range(((n - 1) - 1024 * blocks) // 64):
        accumulate(1024 * blocks + 64 * j, 8 * j)
    accumulate(n - 64, 192 - 64 - 7)
    h = (n * _P64_1) & _M64
    for i in range(4):
        h += _fold(acc[2 * i] ^ _u64(secret, 11 + 16 * i), acc[2 * i + 1] ^ _u64(secret, 19 + 16 * i))
    return _avalanche(h & _M64)


def hash_bytes(data: bytes) -> int:
    """The hash of ``data`` as hash_tensors defines it, as a signed 64-bit int (the op's int64)."""
    total, level = len(data), 0
    while -(-len(data) // HASH_CHUNK) > 1:
        hs = [xxh3_64(data[i:i + HASH_CHUNK], (level << 56) + i // HASH_CHUNK) for i in range(0, len(data), HASH_CHUNK)]
        data = b"".join(h.to_bytes(8, "little") for h in hs)
        level += 1
    last = xxh3_64(data, level << 56).to_bytes(8, "little") if data else b""
    h = xxh3_64(last, total)
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
