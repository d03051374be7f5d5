"""One interface for every implementation: all_reduce / all_reduce_ / all_reduce_async, all_gather,
broadcast, and ``buffer`` (a tensor that SHM can reduce without a copy in).

Example (under torchrun, gloo):
    >>> import torch, torchstrategies as ts
    >>> from torchstrategies import collectives as C
    >>> grads = [torch.ones(10), torch.ones(3, dtype=torch.float64)]          # doctest: +SKIP
    >>> C.all_reduce_(grads, op="sum", options=ts.CommunicationOptions(implementation="shm"))
    >>> fut = C.all_reduce_async(grads, op="mean"); ...; fut.wait()   # a torch.futures.Future

AUTO picks the implementation from this table; the first row that matches wins (see docs/collectives.md
for the benchmark behind it):

    1. tensors on CUDA                                   -> NCCL
    1b. a dtype our kernels do not take (bool, int8, ...) -> GLOO
    2. every rank of the group on this host              -> SHM
    3. world group over several hosts, some with >1 rank -> HIERARCHICAL
    4. otherwise (ranks on several hosts)                -> RING where the shipped measurement shows our C++
                                                            TCP ring beating gloo for the message size
                                                            (``ring.preferred``), else GLOO
    (TREE over gloo point-to-point was slower than gloo's own all-reduce; it remains an explicit choice.)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Union

import torch
import torch.distributed as dist

from torchstrategies.collectives import debug, hierarchical, native, ring, shm, topology, tree
from torchstrategies.collectives._common import SUPPORTED_DTYPES
from torchstrategies.collectives.options import CommunicationImplementation as Impl
from torchstrategies.collectives.options import CommunicationOptions
from torchstrategies.collectives.packing import make_packs
from torchstrategies.collectives.plan import Plan, PlanCache
from torchstrategies.reduce_op import ReduceOp

__all__ = ["all_reduce", "all_reduce_", "all_reduce_async", "all_gather", "broadcast", "buffer",
           "choose", "TREE_MAX_BYTES"]

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]  # noqa: UP007 - a runtime alias on py3.10
TREE_MAX_BYTES = 64 << 10
_DEFAULT = CommunicationOptions()
_executors: dict[tuple[int, ...], ThreadPoolExecutor] = {}
_pending: dict[tuple[int, ...], list[Future]] = {}
_lock = threading.Lock()


# ----------------------------------------------------------------------------------------- choice
def choose(impl: Impl, tensors: Sequence[torch.Tensor], group: Any) -> Impl:
    """Resolves AUTO by the table above and checks that an explicit choice can run here."""
    cuda = any(t.is_cuda for t in tensors)
    if impl is Impl.AUTO:
        if cuda:
            return Impl.NCCL
        if any(t.dtype not in SUPPORTED_DTYPES for t in tensors):
            return Impl.GLOO  # e.g. bool, int8, complex: only the native all-reduce takes them
        hosts = topology.group_hosts(group)
        if len(set(hosts)) == 1:
            return Impl.SHM
        is_world = group is None or group is dist.group.WORLD
        if is_world and len(set(hosts)) < len(hosts):
            return Impl.HIERARCHICAL
        return Impl.RING if ring.preferred(sum(t.numel() * t.element_size() for t in tensors)) else Impl.GLOO
    if impl is Impl.NCCL:
        if not cuda or dist.get_backend(group) != "nccl":
            raise ValueError(
                f"implementation NCCL needs CUDA tensors and an NCCL process group; got tensors on "
                f"{tensors[0].device if tensors else 'cpu'} and backend {dist.get_backend(group)!r}"
            )
    elif impl in (Impl.SHM, Impl.HIERARCHICAL, Impl.RING, Impl.TREE) and cuda and impl is not Impl.RING:
        raise ValueError(f"implementation {impl.name} works on CPU tensors; got tensors on {tensors[0].device}")
    if impl is Impl.SHM and not shm.supported(group):
        raise ValueError(
            f"implementation SHM needs every rank of the group on one host; {topology.describe_group(group)} "
            f"spans hosts {sorted(set(topology.group_hosts(group)))}"
        )
    return impl


# ---------------------------------------------------------------------------------------- helpers
def _as_list(what: str, tensors: TensorOrList) -> tuple[list[torch.Tensor], bool]:
    if isinstance(tensors, torch.Tensor):
        return [tensors], True
    try:
        items = list(tensors)
    except TypeError:
        raise TypeError(f"{what}: expected a Tensor or a list of Tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
    return items, False


def _validate(what: str, items: list[torch.Tensor], op: ReduceOp, impl: Impl) -> None:
    ncuda = sum(1 for t in items if t.is_cuda)
    if 0 < ncuda < len(items):
        raise ValueError(
            f"{what}: {ncuda} of {len(items)} tensors are on CUDA and the rest are not; use one device type")
    native_ok = impl in (Impl.GLOO, Impl.NCCL)
    mean = op is ReduceOp.MEAN
    for i, t in enumerate(items):
        if not native_ok and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{what}: tensors[{i}] has unsupported dtype {t.dtype} for {impl.name} "
                f"(supported: {', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}; "
                f"GLOO takes others)"
            )
        if mean and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"{what}: MEAN needs floating-point tensors, tensors[{i}] is {t.dtype}")


def _timeout(options: CommunicationOptions, group: Any) -> float:
    return float(options.timeout_seconds) if options.timeout_seconds is not None else topology.group_timeout(group)


def _flush(key: tuple[int, ...]) -> None:
    with _lock:
        futs = _pending.pop(key, [])
    for f in futs:
        f.exception()  # waits; errors are reported by the future's wait()


def _run_flat(impl: Impl, flat: torch.Tensor, op: ReduceOp, group: Any, timeout: float, world: int) -> None:
    if impl is Impl.SHM:
        shm.get_communicator(group, timeout).all_reduce_(flat, op, timeout)  # MEAN scaled in C++
        return
    if impl is Impl.RING:
        ring.all_reduce_(flat, op, group, timeout)  # MEAN scaled in C++
        return
    fn = {Impl.TREE: tree.all_reduce_, Impl.HIERARCHICAL: hierarchical.all_reduce_,
          Impl.GLOO: native.all_reduce_, Impl.NCCL: native.all_reduce_}[impl]
    fn(flat, op, group, timeout)
    if op is ReduceOp.MEAN:
        flat.div_(world)


def _reduce(items: list[torch.Tensor], op: ReduceOp, group: Any, options: CommunicationOptions,
            inplace: bool, impl: Impl, timeout: float) -> list[torch.Tensor]:
    world = dist.get_world_size(group)
    results: list[torch.Tensor] = list(items) if inplace else [None] * len(items)  # type: ignore[list-item]
    if world == 1:
        if not inplace:
            results = [t.clone() for t in items]
        return results
    if impl is Impl.SHM:
        _reduce_shm(items, results, op, group, inplace, timeout)
        return results
    for pack in make_packs(items, options.bytes_per_pack):
        t0 = items[pack.indices[0]]
        if len(pack.indices) == 1 and t0.is_contiguous():
            flat = t0.view(-1) if inplace else t0.clone().view(-1)
            _run_flat(impl, flat, op, group, timeout, world)
            if not inplace:
                results[pack.indices[0]] = flat.view(t0.shape)
            continue
        flat = pack.fill(items, None)
        _run_flat(impl, flat, op, group, timeout, world)
        if inplace:
            pack.copy_back(items)
        else:
            for i, v in pack.views(items):
                results[i] = v
    return results


def _reduce_shm(items: list[torch.Tensor], results: list[torch.Tensor], op: ReduceOp, group: Any,
                inplace: bool, timeout: float) -> None:
    """SHM takes a list as it is: one in-place call per dtype over the tensors in list order, no packing.

    Every tensor of a dtype joins that dtype's call, whatever its layout (a non-contiguous one through a
    contiguous copy, copied back), so the calls are the same on every rank. The reduction is in place, so
    a tensor whose memory overlaps an earlier one in the list (the same tensor twice, a view of another)
    works on a private copy, copied back: each is reduced exactly once, as packing did.
    """
    comm = shm.get_communicator(group, timeout)
    for pack in make_packs(items, 0):  # one group per dtype, in list order
        idxs = pack.indices
        work = []
        for i in idxs:
            t = items[i]
            if not inplace:
                w = results[i] = t.clone(memory_format=torch.contiguous_format)
            else:
                w = t if t.is_contiguous() else t.contiguous()
            work.append(w)
        if inplace and len(work) > 1:
            _unalias(work)
        if len(work) == 1:
            comm.all_reduce_(work[0], op, timeout)  # zero-copy if it lies in a collectives.buffer()
        else:
            comm.all_reduce_many_(work, op, timeout)  # MEAN is scaled in C++
        if inplace:
            for i, w in zip(idxs, work):
                if w is not items[i]:
                    items[i].copy_(w)


def _unalias(work: list[torch.Tensor]) -> None:
    """Replaces every tensor whose bytes overlap an earlier one's by a private copy (in place in ``work``)."""
    spans = sorted((w.data_ptr(), w.data_ptr() + w.numel() * w.element_size(), k)
                   for k, w in enumerate(work) if w.numel())
    end = -1
    for lo, hi, k in spans:
        if lo < end:
            work[k] = work[k].clone()
        end = max(end, hi)


def _prepare(what: str, tensors: TensorOrList, op: Any, group: Any, options: CommunicationOptions | None,
             sync: bool = True) -> tuple[list[torch.Tensor], bool, ReduceOp, CommunicationOptions, Impl, float]:
    items, single = _as_list(what, tensors)
    rop = ReduceOp.from_any(op)
    if options is not None and not isinstance(options, CommunicationOptions):
        raise TypeError(f"{what}: options must be CommunicationOptions or None, got {type(options).__name__}")
    opts = options if options is not None else _DEFAULT
    timeout = _timeout(opts, group)
    if sync or debug.enabled():
        _flush(topology.group_key(group))
    if debug.enabled():  # first, before any other collective (AUTO's host gather) can pair with it
        debug.check("all_reduce", rop, items, group, timeout)
    impl = choose(opts.implementation, items, group)
    _validate(what, items, rop, impl)
    return items, single, rop, opts, impl, timeout


# --------------------------------------------------------------------------------------- public API
def all_reduce(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
               options: CommunicationOptions | None = None) -> Any:
    """Returns the reduction of ``tensors`` over the group's ranks (new tensors; inputs untouched).

    Args:
        tensors: a Tensor or a list of Tensors (any shapes, mixed dtypes are packed per dtype).
        op: ReduceOp SUM, MEAN, MIN or MAX (or its name).
        group: a torch.distributed group; None is the world.
        options: CommunicationOptions (implementation, bytes_per_pack, timeout_seconds).

    Returns:
        A Tensor if a Tensor was given, else a list in the same order.

    Raises:
        DeadlineExceededError: not every rank arrived within the timeout (a peer died or hung).
        ValueError / TypeError: bad input, or a call that differs across ranks (SHM, debug mode).
    """
    if type(tensors) is torch.Tensor and tensors.is_contiguous():
        out = tensors.clone()
        if _fast(out, op, group, options):
            return out
    items, single, rop, opts, impl, timeout = _prepare("all_reduce", tensors, op, group, options)
    results = _reduce(items, rop, group, opts, False, impl, timeout)
    if single:
        _remember(items[0], op, group, options, impl, rop, timeout)
    return results[0] if single else results


_PLANS = PlanCache()


def _fast(t: torch.Tensor, op: Any, group: Any, options: CommunicationOptions | None) -> bool:
    """The hot path for one contiguous CPU tensor: the cached ``Plan`` of an identical earlier call.

    Returns False when the general path must run (first call, debug mode, pending async work, a plan
    made for a destroyed group or for options since mutated, ...).
    """
    if _pending or debug.enabled() or not t.is_cpu or not t.is_contiguous():
        return False
    plan = _PLANS.get(group, options, op, t.dtype, t.numel() * t.element_size() <= TREE_MAX_BYTES)
    if plan is None:
        return False
    plan.run(t)
    return True


def _remember(t: torch.Tensor, op: Any, group: Any, options: CommunicationOptions | None, impl: Impl,
              rop: ReduceOp, timeout: float) -> None:
    """Stores the plan of a single-tensor call the general path just ran."""
    if not t.is_cpu:
        return
    world = dist.get_world_size(group)
    run: Any
    if world == 1:
        impl, run = Impl.GLOO, None  # nothing to exchange
    elif impl is Impl.SHM:
        run = shm.get_communicator(group, timeout).kernel(rop, timeout)
    else:
        def run(x: torch.Tensor) -> None:
            _run_flat(impl, x.view(-1), rop, group, timeout, world)
    snapshot = None if options is None else (options.bytes_per_pack, options.timeout_seconds, options.implementation)
    try:
        plan = Plan(impl, world, snapshot, run, group)
    except TypeError:  # a group that takes no weak reference: no caching
        return
    _PLANS.put(group, options, op, t.dtype, t.numel() * t.element_size() <= TREE_MAX_BYTES, plan)


def all_reduce_(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                options: CommunicationOptions | None = None) -> Any:
    """Like ``all_reduce`` but writes the result into ``tensors`` and returns them."""
    if type(tensors) is torch.Tensor and _fast(tensors, op, group, options):
        return tensors
    items, single, rop, opts, impl, timeout = _prepare("all_reduce_", tensors, op, group, options)
    _reduce(items, rop, group, opts, True, impl, timeout)
    if single:
        _remember(items[0], op, group, options, impl, rop, timeout)
    return items[0] if single else items


def all_reduce_async(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: Any = None,
                     options: CommunicationOptions | None = None) -> torch.futures.Future[Any]:
    """Starts an in-place all-reduce of ``tensors`` on a background thread; returns a ``torch.futures.Future``.

    The future is the one async type of the package (the type DDP's comm hooks return): ``wait()`` returns
    what ``all_reduce_`` returns (the Tensor, or the list) or raises the collective's named error
    (UnavailableError, DeadlineExceededError, ValueError for a mismatched call). Operations on one group run
    in the order they were started; a synchronous call on the group first waits for the pending ones.
    Don't touch ``tensors`` until ``wait()`` returns.
    """
    items, single, rop, opts, impl, timeout = _prepare("all_reduce_async", tensors, op, group, options, sync=False)
    key = topology.group_key(group)
    if impl is Impl.SHM:
        shm.get_communicator(group, timeout)  # collective set-up in the caller's thread
    elif impl is Impl.HIERARCHICAL:
        hierarchical.layout()
    result: torch.futures.Future[Any] = torch.futures.Future()
    with _lock:
        ex = _executors.get(key)
        if ex is None:
            ex = _executors[key] = ThreadPoolExecutor(1, thread_name_prefix="torchstrategies-collective")
        work = ex.submit(_reduce, items, rop, group, opts, True, impl, timeout)
        _pending.setdefault(key, []).append(work)

    def finish(done: Future) -> None:
        _forget(key, done)
        exc = done.exception()
        if exc is not None:
            result.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the value type
        else:
            out = done.result()
            result.set_result(out[0] if single else out)

    work.add_done_callback(finish)
    return result


def _forget(key: tuple[int, ...], fut: Future) -> None:
    """Drops a finished future from the pending list (so the hot path is enabled again)."""
    with _lock:
        futs = _pending.get(key)
        if futs is not None:
            if fut in futs:
                futs.remove(fut)
            if not futs:
                del _pending[key]


def all_gather(tensor: torch.Tensor, group: Any = None, options: CommunicationOptions | None = None,
               axis: int = 0) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` (same shape on all ranks) along ``axis``, in rank order."""
    items, _ = _as_list("all_gather", tensor)
    if len(items) != 1:
        raise TypeError("all_gather: expected one Tensor")
    t = items[0].contiguous()
    opts = _DEFAULT.merge(options)
    timeout = _timeout(opts, group)
    key = topology.group_key(group)
    _flush(key)
    if debug.enabled():
        debug.check("all_gather", None, [t], group, timeout)
    impl = choose(opts.implementation, [t], group)
    if impl is Impl.SHM:
        stacked = shm.get_communicator(group, timeout).all_gather(t, timeout)
    else:
        stacked = native.all_gather(t, group, timeout)
    if t.dim() == 0:
        return stacked
    return torch.cat(list(stacked.unbind(0)), dim=axis)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None,
              options: CommunicationOptions | None = None) -> torch.Tensor:
    """Copies group rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place) and returns it."""
    items, _ = _as_list("broadcast", tensor)
    t = items[0]
    ranks = topology.group_ranks(group)
    if not 0 <= src < len(ranks):
        raise ValueError(f"broadcast: src {src} is not a rank of {topology.describe_group(group)}")
    opts = _DEFAULT.merge(options)
    timeout = _timeout(opts, group)
    _flush(topology.group_key(group))
    if debug.enabled():
        debug.check("broadcast", src, [t], group, timeout)
    impl = choose(opts.implementation, [t], group)
    work = t if t.is_contiguous() else t.contiguous()
    if impl is Impl.SHM:
        shm.get_communicator(group, timeout).broadcast_(work, src, timeout)
    else:
        native.broadcast_(work, src, group, timeout)
    if work is not t:
        t.copy_(work)
    return t


def buffer(numel: int, dtype: torch.dtype = torch.float32, group: Any = None,
           options: CommunicationOptions | None = None) -> torch.Tensor:
    """A zeroed 1-D tensor that SHM all-reduces in place without a copy in (collective call).

    When the group is on one host and the implementation is AUTO or SHM, the tensor lives in the
    group's shared-memory segment; otherwise it is an ordinary tensor. Gradient buckets use it.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"buffer: numel must be a non-negative int, got {numel!r}")
    opts = _DEFAULT.merge(options)
    if opts.implementation in (Impl.AUTO, Impl.SHM) and dtype in SUPPORTED_DTYPES and shm.supported(group):
        b = shm.get_communicator(group, _timeout(opts, group)).buffer(numel, dtype, _timeout(opts, group))
        b.zero_()
        return b
    return torch.zeros(numel, dtype=dtype)
