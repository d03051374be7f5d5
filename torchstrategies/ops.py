"""Typed wrappers around ``torch.ops.torchstrategies``: the only Python caller of our kernels.

Validation is done once, in C++ (csrc/checks.h, TORCH_CHECK), so the fast path adds no per-tensor
Python work. When the kernel rejects its input, the wrapper re-examines it in Python and raises the
clearer Python error (ValueError / TypeError naming the index and the values), else re-raises.

Example:
    >>> import torch, torchstrategies as ts
    >>> xs = [torch.ones(5) * i for i in range(4)]
    >>> ts.ops.accumulate_n(xs)
    tensor([6., 6., 6., 6., 6.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from torchstrategies._ext import _C  # loads the extension or raises ImportError

__all__ = ["accumulate_n", "tree_reduce", "add_n", "accumulate_", "accumulate_grouped_", "hash_tensors",
           "agreement_hash_", "agreement_record_", "agreement_piece", "agreement_piece_fingerprints",
           "SUPPORTED_DTYPES", "FLOAT_DTYPES", "DTYPE_CODES"]

_ops = torch.ops.torchstrategies
T = TypeVar("T")

# The dtype table comes from C++ (csrc/checks.h kernel_dtype, exported as _C.DTYPES): torch.dtype ->
# (code in call descriptors, the kernels' code or -1, is floating point). Everything else derives from it.
_DTYPES: dict[torch.dtype, tuple[int, int, bool]] = {d: (int(c), int(k), bool(f)) for d, (c, k, f) in
                                                     _C.DTYPES.items()}
# The dtypes our kernels take, in the kernels' order, and the floating-point ones among them.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(sorted((d for d, v in _DTYPES.items() if v[1] >= 0),
                                                         key=lambda d: _DTYPES[d][1]))
FLOAT_DTYPES: tuple[torch.dtype, ...] = tuple(d for d in SUPPORTED_DTYPES if _DTYPES[d][2])
# Codes compared across ranks in call descriptors (any dtype a collective may see, GLOO's too).
DTYPE_CODES: dict[torch.dtype, int] = {d: v[0] for d, v in _DTYPES.items()}
_SUPPORTED = SUPPORTED_DTYPES


def _as_list(op: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as a list; TypeError for a single Tensor or a non-iterable."""
    if type(tensors) is list:
        return tensors
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{op}: expected a list of tensors, got a single Tensor of shape {tuple(tensors.shape)}")
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(f"{op}: expected a list of tensors, got {type(tensors).__name__}") from None


def _problem(op: str, items: Sequence[object], out: object = None, name: str = "out") -> Exception | None:
    """The first thing wrong with the inputs, as the exception to raise (None if nothing is)."""
    if not items:
        return ValueError(f"{op}: expected a non-empty list of tensors, got an empty list")
    tensors: list[torch.Tensor] = []
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{op}: tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        tensors.append(t)
    if out is not None and not isinstance(out, torch.Tensor):
        return TypeError(f"{op}: {name} is a {type(out).__name__}, expected a torch.Tensor")
    t0 = tensors[0]
    if t0.dtype not in _SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in _SUPPORTED)
        return TypeError(f"{op}: unsupported dtype {t0.dtype} (supported: {names})")
    others = [(f"tensors[{i}]", t) for i, t in enumerate(tensors[1:], start=1)]
    if out is not None:
        others.append((name, out))
    for label, t in others:
        for what, a, b in (("shape", tuple(t.shape), tuple(t0.shape)), ("dtype", t.dtype, t0.dtype),
                           ("device", t.device, t0.device)):
            if a != b:
                return ValueError(f"{op}: {label} has {what} {a} but tensors[0] has {what} {b}")
    return None


def _check_same(op: str, items: Sequence[object], out: object = None, name: str = "out") -> None:
    """Raises the error _problem finds (used where the C++ checks do not run: fakes, add_n)."""
    err = _problem(op, items, out, name)
    if err is not None:
        raise err


def _run(op: str, fn: Callable[..., T], items: Sequence[object], out: object, name: str, *args: object) -> T:
    """Calls the kernel; if it rejects the input, raises the clearer Python error when there is one."""
    try:
        return fn(*args)
    except (RuntimeError, TypeError) as e:
        err = _problem(op, items, out, name)
        if err is not None:
            raise err from e
        raise


def _check_scale(op: str, scale: float | None, items: Sequence[object]) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
    if items and isinstance(items[0], torch.Tensor) and not items[0].dtype.is_floating_point:
        raise TypeError(f"{op}: scale={scale} needs a floating-point dtype, got {items[0].dtype}")
    return float(scale)


def accumulate_n(
    tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """Returns ``scale * sum(tensors)`` computed in one fused pass over memory (``out`` may alias an input)."""
    return _reduce("accumulate_n", _ops.accumulate_n, _ops.accumulate_n_out, tensors, out, scale)


def tree_reduce(
    tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """Returns ``scale * sum(tensors)`` summed in balanced pairwise order (error grows like log N)."""
    return _reduce("tree_reduce", _ops.tree_reduce, _ops.tree_reduce_out, tensors, out, scale)


def _reduce(
    op: str,
    kernel: Callable[..., torch.Tensor],
    out_kernel: Callable[..., object],
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """The body of ``accumulate_n`` and ``tree_reduce``: ``kernel`` (with autograd) or its out= form."""
    items = _as_list(op, tensors)
    scale = _check_scale(op, scale, items)
    if out is None:
        if not _fresh_out_ok(items):
            return _run(op, kernel, items, None, "out", items, scale)
        fresh = torch.empty(items[0].shape, dtype=items[0].dtype, device=items[0].device)
        _run(op, out_kernel, items, None, "out", items, scale, fresh)
        return fresh  # no gradient needed: the out= kernel skips the Python autograd wrapper
    _run(op, out_kernel, items, out, "out", items, scale, out)
    _bump(out)
    return out


def _fresh_out_ok(items: Sequence[object]) -> bool:
    """Whether the result needs no autograd (so the cheaper out= kernel into a new tensor can serve)."""
    if not items or not isinstance(items[0], torch.Tensor):
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(_requires_grad(t) for t in items)


def accumulate_(dst: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adds ``sum(tensors)`` into ``dst`` in one pass and returns ``dst``."""
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"accumulate_: dst is a {type(dst).__name__}, expected a torch.Tensor")
    items = _as_list("accumulate_", tensors)
    if torch.is_grad_enabled() and (dst.requires_grad or any(_requires_grad(t) for t in items)):
        if dst.is_leaf and dst.requires_grad:
            raise RuntimeError(
                "accumulate_: a leaf Variable that requires grad is being used in an in-place operation "
                f"(dst of shape {tuple(dst.shape)}); call it under torch.no_grad()"
            )
        _check_same("accumulate_", items, dst, name="dst")
        return dst.add_(accumulate_n(items))  # torch records the in-place op and its gradient
    _run("accumulate_", _ops.accumulate_, items, dst, "dst", dst, items)
    _bump(dst)
    return dst


def accumulate_grouped_(dsts: Sequence[torch.Tensor], groups: Sequence[Sequence[torch.Tensor]]) -> None:
    """``accumulate_(dsts[i], groups[i])`` for every i, in one call (one pass over each ``dsts[i]``).

    Every group has the same number of tensors; no tensor may require grad (call it under
    ``torch.no_grad()`` on tensors outside any graph, e.g. gradients).

    Raises:
        ValueError: groups of different lengths, or a group's tensors differ from its dst (the index named).
        RuntimeError: a tensor requires grad.
    """
    if len(dsts) != len(groups):
        raise ValueError(f"accumulate_grouped_: {len(dsts)} destinations but {len(groups)} groups")
    if not dsts:
        return
    per = len(groups[0])
    for i, g in enumerate(groups):
        if len(g) != per:
            raise ValueError(f"accumulate_grouped_: group {i} has {len(g)} tensors, group 0 has {per}")
    if torch.is_grad_enabled() and any(_requires_grad(t) for t in (*dsts, *(t for g in groups for t in g))):
        raise RuntimeError("accumulate_grouped_: a tensor requires grad; call it under torch.no_grad() on "
                           "tensors outside any graph")
    flat = [g[j] for j in range(per) for g in groups]
    try:
        _ops.accumulate_grouped_(list(dsts), flat)
    except (RuntimeError, TypeError) as e:
        for i, (dst, g) in enumerate(zip(dsts, groups)):
            err = _problem("accumulate_grouped_", list(g), dst, name=f"dsts[{i}]")
            if err is not None:
                raise err from e
        raise
    _bump_all(dsts)


def _requires_grad(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _bump(t: torch.Tensor) -> None:
    """Tells autograd that ``t`` was written in place (as torch's own in-place kernels do), so a graph that
    saved ``t`` raises at backward instead of computing a wrong gradient."""
    if not t.is_inference():
        torch.autograd.graph.increment_version(t)


def _bump_all(ts: Sequence[torch.Tensor]) -> None:
    """``_bump`` of every tensor in ``ts``, in one call."""
    live = [t for t in ts if not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)


def add_n(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Returns ``sum(tensors)`` by sequential torch adds: TF's ADD_N, the baseline."""
    items = _as_list("add_n", tensors)
    if not items:
        _check_same("add_n", items)
    t0 = items[0]
    shape, dtype, device = getattr(t0, "shape", None), getattr(t0, "dtype", None), getattr(t0, "device", None)
    for t in items:  # cheap check; torch's adds would broadcast silently
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device:
            _check_same("add_n", items)
    if dtype not in _SUPPORTED:
        _check_same("add_n", items)
    result = t0.clone()
    for t in items[1:]:
        result = result + t
    return result


def hash_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An int64 tensor (on the tensors' device) of an exact, order-sensitive 64-bit hash of each tensor's bytes
    in logical order (csrc/core/hash.h): equal exactly when the bytes are, up to hash collisions.

    Any dtype; the tensors must be strided and on one device; an empty list gives an empty CPU tensor.
    """
    items = _as_list("hash_tensors", tensors)
    if not items:
        return torch.zeros(0, dtype=torch.int64)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hash_tensors: tensors[{i}] is {type(t).__name__}, expected a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"hash_tensors: tensors[{i}] has layout {t.layout}; only strided (dense) tensors are "
                             "hashed (call .to_dense() first)")
    return _ops.hash_tensors([t.detach() for t in items])


def agreement_hash_(tensors: Sequence[torch.Tensor], state: torch.Tensor, payload: torch.Tensor,
                    forced_from: int, piece: int, slices: int) -> None:
    """The per-step agreement check's tensor work before the optimizer's update (``distribute/agreement_step.py``):
    the tracked tensors (before ``forced_from``) that moved since ``state`` recorded them (recorded now) and the
    forced ones (from ``forced_from`` on), hashed whole, and piece ``piece`` of ``slices`` (``0 <= piece <
    slices``) of the tracked tensors' bytes laid end to end, hashed per tensor; then the all-reduce's wire laid
    out in ``payload`` (int64, 9n: the wire ``[flags, whole, piece, -flags, -whole, -piece]``, then this rank's
    own ``[flags, whole, piece]``). ``state``: int64 (n, 3) on the CPU, a version of -1 for a new list. Called
    every step: no checks here beyond the kernel's."""
    _ops.agreement_hash_(tensors, state, payload, forced_from, piece, slices)


def agreement_record_(tensors: Sequence[torch.Tensor], state: torch.Tensor) -> None:
    """After an optimizer's update: records in ``state`` every position of ``tensors`` as it is now (what moved
    during the step is the optimizer's own write: no news at the next :func:`agreement_hash_`)."""
    _ops.agreement_record_(tensors, state)


def agreement_piece(tensors: Sequence[torch.Tensor], piece: int, slices: int) -> torch.Tensor:
    """Piece ``piece`` of ``slices`` of the tensors' bytes laid end to end, the rotating slice's one definition
    (``agreement_hash_`` hashes the same pieces): an int64 ``(len(tensors), 2)`` CPU tensor whose row ``i`` is
    the element range ``[a, b)`` of tensor ``i``'s flat view in the piece (``a == b``: none; a tensor that is
    not contiguous whole, in the piece that holds its first byte). Reads shapes only, on any device; raises
    ``RuntimeError`` naming ``piece`` and ``slices`` unless ``slices >= 1`` and ``0 <= piece < slices``."""
    return _ops.agreement_piece(tensors, piece, slices)


def agreement_piece_fingerprints(tensors: Sequence[torch.Tensor], piece: int, slices: int) -> torch.Tensor:
    """Per tensor, the fingerprint of its part in piece ``piece`` of ``slices`` (:func:`agreement_piece`'s
    ranges): the hash of those bytes mixed with the tensor's dtype, shape and range, as an int64
    ``(len(tensors),)`` CPU tensor, 0 where a tensor has no part in the piece. The values
    :func:`agreement_hash_` writes for the same piece; the in-process strategies compare them replica by
    replica. Tensors on any devices (each device's hashed in one kernel call there); the same errors as
    :func:`agreement_piece`."""
    return _ops.agreement_piece_fingerprints(tensors, piece, slices)


# ---- torch.compile / FakeTensor support: shapes only, the same checks as the kernels ----------------


def _fake_reduce(op: str) -> Callable[..., torch.Tensor]:
    def fake(tensors, scale=None):
        _check_same(op, list(tensors))
        return torch.empty_like(tensors[0], memory_format=torch.contiguous_format)

    return fake


def _fake_reduce_out(op: str) -> Callable[..., None]:
    def fake(tensors, scale, out):
        _check_same(op, list(tensors), out)

    return fake


def _fake_accumulate_(dst, tensors):
    _check_same("accumulate_", list(tensors), dst, name="dst")


def _fake_accumulate_grouped_(dsts, tensors):
    n = len(dsts)
    for i, dst in enumerate(dsts):
        _check_same("accumulate_grouped_", list(tensors[i::n]), dst, name=f"dsts[{i}]")


# Each fake names the op the user called, so a traced call fails with the eager call's error.
torch.library.register_fake("torchstrategies::accumulate_n")(_fake_reduce("accumulate_n"))
torch.library.register_fake("torchstrategies::tree_reduce")(_fake_reduce("tree_reduce"))
torch.library.register_fake("torchstrategies::accumulate_n_out")(_fake_reduce_out("accumulate_n"))
torch.library.register_fake("torchstrategies::tree_reduce_out")(_fake_reduce_out("tree_reduce"))
torch.library.register_fake("torchstrategies::accumulate_")(_fake_accumulate_)
torch.library.register_fake("torchstrategies::accumulate_grouped_")(_fake_accumulate_grouped_)
torch.library.register_fake("torchstrategies::hash_tensors")(
    lambda tensors: tensors[0].new_empty((len(tensors),), dtype=torch.int64))
torch.library.register_fake("torchstrategies::agreement_hash_")(lambda tensors, state, payload, f, piece, n: None)
torch.library.register_fake("torchstrategies::agreement_record_")(lambda tensors, state: None)


def _fake_agreement_piece(op: str, *shape: int) -> Callable[..., torch.Tensor]:
    def fake(tensors, piece, slices):
        if not (slices >= 1 and 0 <= piece < slices):
            raise RuntimeError(f"{op}: piece {piece} of {slices} slices: expected slices >= 1 and 0 <= piece < "
                               "slices")
        return torch.empty((len(tensors), *shape), dtype=torch.int64)   # (under the fake mode: a fake CPU tensor)

    return fake


torch.library.register_fake("torchstrategies::agreement_piece")(_fake_agreement_piece("agreement_piece", 2))
torch.library.register_fake("torchstrategies::agreement_piece_fingerprints")(
    _fake_agreement_piece("agreement_piece_fingerprints"))


def _setup_ctx(ctx, inputs, output):
    tensors, scale = inputs
    ctx.n = len(tensors)
    ctx.scale = scale


def _backward(ctx, grad):
    # d(scale * sum)/d(x_i) = scale for every input. The gradient structure must mirror the inputs as
    # torch.library sees them: with scale=None it flattens the optional away, so the list comes alone.
    if ctx.scale is None:
        return [grad] * ctx.n
    return [grad * ctx.scale] * ctx.n, None


torch.library.register_autograd("torchstrategies::accumulate_n", _backward, setup_context=_setup_ctx)
torch.library.register_autograd("torchstrategies::tree_reduce", _backward, setup_context=_setup_ctx)
