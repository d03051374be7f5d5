"""Copying a live worker's state to a returning one over the generation's group: tensors and a typed
header, nothing unpickled.

:func:`encode` turns a nested structure (dicts with str/int keys, lists, tuples, and leaves that are tensors,
int, float, bool, str or None) into a JSON header, where each tensor is ``{"t": i, "dtype", "shape"}``, and
the list of tensors; :func:`decode` rebuilds it. :func:`broadcast_state` sends both from one member: the
header's length, the header (bytes), then the tensors packed per dtype, one broadcast each. Nothing a
receiver reads is executed or unpickled: an unknown dtype or tag in the header is a ``ValueError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from torchstrategies.strategies.fault_tolerance.group import Group

__all__ = ["encode", "decode", "broadcast_state"]

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def encode(obj: object) -> tuple[bytes, list[torch.Tensor]]:
    """(JSON header, tensors) of ``obj``.

    Raises:
        TypeError: a leaf of another type, or a dict key that is neither str nor int (named by its path).
    """
    tensors: list[torch.Tensor] = []

    def walk(x: object, path: str) -> object:
        if isinstance(x, torch.Tensor):
            if str(x.dtype) not in _DTYPES:
                raise TypeError(f"state at {path}: tensors of dtype {x.dtype} cannot be transferred")
            tensors.append(x.detach())
            return {"t": len(tensors) - 1, "dtype": str(x.dtype), "shape": list(x.shape)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"state at {path}: dict key {k!r} is neither str nor int")
                items.append([k, walk(v, f"{path}.{k}")])
            return {"d": items}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "u": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        raise TypeError(f"state at {path}: {type(x).__name__} cannot be transferred (tensors, numbers, str, "
                        "None, and dicts/lists/tuples of them)")

    header = walk(obj, "state")
    return json.dumps(header, separators=(",", ":")).encode(), tensors


def _tensor_specs(header: object, out: list[tuple[int, torch.dtype, list[int]]]) -> None:
    if isinstance(header, dict):
        if "t" in header:
            dtype = _DTYPES.get(header["dtype"])
            if dtype is None:
                raise ValueError(f"state header names an unknown dtype {header['dtype']!r}")
            out.append((int(header["t"]), dtype, [int(s) for s in header["shape"]]))
        for v in header.values():
            _tensor_specs(v, out)
    elif isinstance(header, list):
        for v in header:
            _tensor_specs(v, out)


def decode(header: bytes, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds what :func:`encode` encoded."""

    def walk(h: Any) -> Any:
        if not isinstance(h, dict) or len(h) == 0:
            raise ValueError(f"malformed state header entry {h!r}")
        if "t" in h:
            return tensors[int(h["t"])]
        if "v" in h:
            return h["v"]
        if "d" in h:
            return {k: walk(v) for k, v in h["d"]}
        if "l" in h:
            return [walk(v) for v in h["l"]]
        if "u" in h:
            return tuple(walk(v) for v in h["u"])
        raise ValueError(f"malformed state header entry {h!r}")

    return walk(json.loads(header.decode()))


def broadcast_state(group: Group, src: int, state: Callable[[], object],
                    device: torch.device, phase: Callable[[str], None] | None = None) -> Any:
    """Member ``src`` sends ``state()`` to every member of ``group``; every member returns the decoded copy
    (``src`` its own). Every member calls it; a failed collective raises ``CollectiveFailed`` (nothing was
    loaded anywhere)."""
    me = group.rank()
    if me == src:
        header, tensors = encode(state())
    else:
        header, tensors = b"", []
    size = torch.tensor([len(header)], dtype=torch.int64)
    group.broadcast(size, src)
    raw = torch.frombuffer(bytearray(header), dtype=torch.uint8) if me == src else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(raw, src)
    if phase is not None:
        phase("heal_header")
    header = raw.numpy().tobytes()
    specs: list[tuple[int, torch.dtype, list[int]]] = []
    _tensor_specs(json.loads(header.decode()), specs)
    specs.sort(key=lambda s: s[0])
    if me != src:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for _, dtype, shape in specs]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(specs):
        by_dtype.setdefault(dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        wire = torch.uint8 if dtype is torch.bool else dtype
        if me == src:
            flat = torch.cat([tensors[i].reshape(-1).to(device=device, dtype=wire) for i in idx])
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=wire, device=device)
        group.broadcast(flat, src)
        if me != src:
            off = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].copy_(flat[off:off + n].view(tensors[i].shape).to(dtype))
                off += n
    return decode(header, tensors)
