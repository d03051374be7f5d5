"""One interface over process groups: all_reduce / all_reduce_ / all_reduce_async, all_gather, broadcast,
``buffer`` (a tensor the shared-memory path reduces without a copy in) and ``new_group``.

Example (under torchrun, on any CPU group):
    >>> import torch, torchstrategies as ts
    >>> from torchstrategies import collectives as C
    >>> grads = [torch.ones(10), torch.ones(3, dtype=torch.float64)]          # doctest: +SKIP
    >>> C.all_reduce_(grads, op="sum", options=ts.CommunicationOptions(implementation="shm"))
    >>> fut = C.all_reduce_async(grads, op="mean"); ...; fut.wait()   # a torch.futures.Future

Where a call runs (``CommunicationOptions.implementation``; the first row that matches wins):

    1. tensors on CUDA (AUTO or NCCL)       -> the group's own CUDA backend (NCCL)
    2. GLOO                                 -> the group's gloo backend (a gloo backend over the group's ranks
                                               is made for groups on another backend)
    3. AUTO, SHM, RING, HIERARCHICAL        -> the "torchstrategies" backend: the group itself when it is on
                                               that backend (AUTO, or the implementation it runs), else one
                                               made over the group's ranks the first time (collective)

Inside the torchstrategies backend AUTO is: every rank on one host -> SHM; several hosts, some with more than
one rank -> HIERARCHICAL; else RING; a dtype or op our kernels do not take goes to gloo (backend.py).
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar, Union, cast

import torch
import torch.distributed as dist

from torchstrategies._ext import _C
from torchstrategies.collectives import backend as _backend
from torchstrategies.collectives import debug, topology
from torchstrategies.collectives._common import from_backend_error, wait_work
from torchstrategies.collectives.debug import agree_on_first_use
from torchstrategies.collectives.group_state import C10dCollectives, GroupState, Target
from torchstrategies.collectives.options import CommunicationImplementation as Impl
from torchstrategies.collectives.options import CommunicationOptions
from torchstrategies.collectives.packing import Pack, make_packs
from torchstrategies.reduce_op import ReduceOp

_log = logging.getLogger("torchstrategies.collectives")

__all__ = ["all_reduce", "all_reduce_", "all_reduce_async", "all_gather", "broadcast", "buffer", "choose",
           "new_group"]

_AllreduceOpts = TypeVar("_AllreduceOpts", bound=dist.AllreduceOptions)
TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]  # noqa: UP007 - a runtime alias on py3.10
_DEFAULT = CommunicationOptions()
_CPU = torch.device("cpu")
_C10D_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.AVG, ReduceOp.MIN: dist.ReduceOp.MIN,
             ReduceOp.MAX: dist.ReduceOp.MAX}


# ------------------------------------------------------------------------------------------------ groups
def new_group(options: CommunicationOptions | None = None, ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """A process group for ``options.implementation`` (collective over the world, like ``dist.new_group``).

    AUTO, SHM, RING, HIERARCHICAL: a group on the ``"torchstrategies"`` backend running that implementation
    (AUTO on a machine with CUDA: ``"cpu:torchstrategies,cuda:nccl"``, CUDA tensors go to NCCL); GLOO: a gloo
    group; NCCL: an NCCL group. ``options.timeout_seconds`` (None: the world group's timeout)
    bounds every collective of the group.

    Args:
        options: CommunicationOptions (None: AUTO).
        ranks: global ranks of the group (None: every rank).

    Returns:
        The ``torch.distributed.ProcessGroup``.

    Example:
        >>> g = new_group(ts.CommunicationOptions(implementation="RING"))   # doctest: +SKIP
        >>> torch.distributed.all_reduce(x, group=g)                        # doctest: +SKIP
    """
    opts = _options("new_group", options)
    seconds = opts.timeout_seconds if opts.timeout_seconds is not None else topology.group_timeout(None)
    timeout = datetime.timedelta(seconds=seconds)
    members = None if ranks is None else list(ranks)
    if opts.implementation is Impl.GLOO:
        return dist.new_group(members, timeout=timeout, backend="gloo")
    if opts.implementation is Impl.NCCL:
        return dist.new_group(members, timeout=timeout, backend="nccl")
    if opts.implementation is Impl.AUTO and torch.cuda.is_available():
        # CUDA tensors to NCCL, CPU ones to ours (AUTO: no options object, which NCCL's creator would refuse)
        return dist.new_group(members, timeout=timeout, backend=f"cpu:{_backend.BACKEND},cuda:nccl")
    return dist.new_group(members, timeout=timeout, backend=_backend.BACKEND,
                          pg_options=_backend.BackendOptions(opts.implementation, seconds))  # its creator logs


def _target(group: dist.ProcessGroup | None, impl: Impl, cuda: bool, timeout: float | None = None) -> Target:
    """Where calls with ``impl`` on ``group`` run, made once per group (``GroupState.targets``). Making it is
    collective (a backend's set-up, the first-use check) and is the first call's: bounded by that call's
    ``timeout`` (None: the group's), as every wait of a call is."""
    g = topology.resolve(group)
    per = GroupState.of(g).targets
    found = per.get((impl, cuda))
    if isinstance(found, Target) and found.generation == topology.generation():
        return found
    if isinstance(found, Target):  # made before topology.clear_caches(): make it again (collective)
        found = None
    if found is not None:
        raise RuntimeError(f"{impl.name} on {topology.describe_group(g)} failed to set up earlier ({found}); "
                           "create a new process group") from found
    _check_choice(impl, cuda, g)
    try:
        made = _make_target(g, impl, cuda, topology.group_timeout(g) if timeout is None else timeout)
    except BaseException as exc:
        per[(impl, cuda)] = exc
        raise
    per[(impl, cuda)] = made
    if not made.ours:  # a backend of ours logged its choice when it was made (backend.make)
        _log.info("implementation %s (asked %s) for %d ranks of %s", "NCCL" if cuda else "GLOO", impl.name,
                  dist.get_world_size(g), topology.describe_group(g))
    return made


def _check_choice(impl: Impl, cuda: bool, g: dist.ProcessGroup) -> None:
    if impl is Impl.TREE:
        _backend.BackendOptions(Impl.TREE)  # raises the ValueError that says TREE was removed
    if impl is Impl.NCCL and (not cuda or "nccl" not in str(dist.get_backend(g))):
        raise ValueError(f"implementation NCCL needs CUDA tensors and an NCCL process group; got "
                         f"{'CUDA' if cuda else 'CPU'} tensors and backend {dist.get_backend(g)!r}")
    if cuda and impl not in (Impl.AUTO, Impl.NCCL):
        raise ValueError(f"implementation {impl.name} works on CPU tensors; got CUDA tensors (use AUTO or NCCL)")


def _cpu_backend(g: dist.ProcessGroup) -> torch._C._distributed_c10d.Backend | None:
    try:
        return g._get_backend(_CPU)
    except RuntimeError:  # a group without a CPU backend (NCCL only)
        return None


def _calls(backend: torch._C._distributed_c10d.Backend) -> C10dCollectives:
    """A c10d Backend as what takes the calls (torch's stubs leave its collectives out; it has them)."""
    return cast(C10dCollectives, backend)


def _make_target(g: dist.ProcessGroup, impl: Impl, cuda: bool, setup: float) -> Target:
    """The target, its set-up (collective) bounded by ``setup`` seconds; made backends keep the group's
    timeout as their calls' default."""
    if cuda:
        return Target(g, False, True, agree_on_first_use(g, setup))
    own = _cpu_backend(g)
    if impl is Impl.GLOO:
        if own is not None and own.name() == "gloo":
            return Target(_calls(own), False, False, agree_on_first_use(g, setup))
        gloo = _backend.gloo_backend(_derived_store(g, "GLOO"), dist.get_rank(g), dist.get_world_size(g),
                                     topology.group_timeout(g), setup)
        return Target(_calls(gloo), False, False, agree_on_first_use(g, setup))
    if own is not None and _C.is_torchstrategies_backend(own):
        if impl is Impl.AUTO or _C.backend_plan(own)[0] == impl.name:
            return Target(_calls(own), True, True, debug.enabled())  # TORCHSTRATEGIES_DEBUG agreed at creation
    made = _backend.make(_derived_store(g, impl.name), dist.get_rank(g), dist.get_world_size(g),
                         topology.group_timeout(g), topology.group_ranks(g), topology.describe_group(g), impl,
                         setup_timeout=setup)
    return Target(_calls(made), True, True, debug.enabled())


def _derived_store(g: dist.ProcessGroup, what: str) -> dist.PrefixStore:
    store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(f"torchstrategies/{g.group_name}/{what}/{topology.generation()}/", store)


def choose(impl: Impl | str, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> Impl:
    """What runs a call with ``impl`` on these tensors: NCCL, GLOO, or the plan of the torchstrategies
    backend (SHM, RING, HIERARCHICAL). Collective the first time per group and implementation."""
    impl = Impl.from_any(impl)
    cuda = any(t.is_cuda for t in tensors)
    target = _target(group, impl, cuda)
    if not target.ours:
        return Impl.NCCL if cuda else Impl.GLOO
    return Impl[_C.backend_plan(target.obj)[0]]


# --------------------------------------------------------------------------------------------- helpers
def _options(what: str, options: object) -> CommunicationOptions:
    if options is not None and not isinstance(options, CommunicationOptions):
        raise TypeError(f"{what}: options must be CommunicationOptions or None, got {type(options).__name__}")
    return options if options is not None else _DEFAULT


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


def _device_kind(what: str, items: list[torch.Tensor]) -> bool:
    ncuda = sum(1 for t in items if t.is_cuda)
    if 0 < ncuda < len(items):
        raise ValueError(f"{what}: {ncuda} of {len(items)} tensors are on CUDA and the rest are not; "
                         "use one device type")
    return ncuda > 0


def _timeout(options: CommunicationOptions, group: dist.ProcessGroup | None) -> float:
    return float(options.timeout_seconds) if options.timeout_seconds is not None else topology.group_timeout(group)


def _wait(work: dist.Work, target: Target, timeout: float, what: str, group: dist.ProcessGroup | None) -> None:
    """Waits for a c10d Work (bounded) and raises the collective's documented error."""
    if target.ours:
        try:
            work.wait()  # the backend bounds every collective by its timeout itself
        except dist.DistBackendError as exc:
            raise from_backend_error(exc) from None
        return
    ranks = topology.group_ranks(group)
    me = dist.get_rank()
    wait_work(work, timeout, what, topology.describe_group(group), [r for r in ranks if r != me],
              topology.resolve(group))


def _translate(exc: BaseException, target: Target) -> BaseException:
    if isinstance(exc, dist.DistBackendError) and target.ours:
        return from_backend_error(exc)
    return exc


# --------------------------------------------------------------------------------------------- all-reduce
class _Launched(NamedTuple):
    """An all-reduce started by ``_launch``: its c10d works, what to do after they finish, and its result."""

    works: list[dist.Work]
    finish: Callable[[], None]
    target: Target
    timeout: float
    results: list[torch.Tensor]
    single: bool  # a Tensor was given (not a list): the result is results[0]

    def result(self) -> TensorOrList:
        return self.results[0] if self.single else self.results


def _launch(what: str, tensors: TensorOrList, op: ReduceOp | str, group: dist.ProcessGroup | None,
            options: CommunicationOptions | None, inplace: bool, sync: bool = True) -> _Launched:
    """Validates and starts the all-reduce (one call per dtype pack)."""
    items, single = _as_list(what, tensors)
    rop = ReduceOp.from_any(op)
    opts = _options(what, options)
    cuda = _device_kind(what, items)
    if rop is ReduceOp.MEAN:
        for i, t in enumerate(items):
            if not (t.is_floating_point() or t.is_complex()):
                raise TypeError(f"{what}: MEAN needs floating-point tensors, tensors[{i}] is {t.dtype}")
    g = topology.resolve(group)
    timeout = _timeout(opts, g)
    target = _target(g, opts.implementation, cuda, timeout)
    if target.debug:
        debug.check("all_reduce", rop, items, g, timeout)
    results = items if inplace else [t.clone(memory_format=torch.contiguous_format) for t in items]
    td = datetime.timedelta(seconds=timeout)
    works: list[dist.Work] = []
    after: list[tuple[Pack, torch.Tensor]] = []  # to copy back on the paths that reduce a packed copy
    if target.avg:  # ours and NCCL: a list of one dtype is reduced as one buffer, MEAN is ReduceOp.AVG
        c10d_op = _C10D_OPS[rop]
        if len(results) == 1:
            works.append(_allreduce(target, results, c10d_op, td, sync))
        else:
            for pack in make_packs(results, opts.bytes_per_pack):
                works.append(_allreduce(target, [results[i] for i in pack.indices], c10d_op, td, sync))
    else:  # gloo: one flat buffer per pack, MEAN as a SUM divided afterwards
        c10d_op = dist.ReduceOp.SUM if rop is ReduceOp.MEAN else _C10D_OPS[rop]
        for pack in make_packs(results, opts.bytes_per_pack):
            first = results[pack.indices[0]]
            flat = first.view(-1) if len(pack.indices) == 1 and first.is_contiguous() else pack.fill(results, None)
            works.append(_allreduce(target, [flat], c10d_op, td, sync))
            after.append((pack, flat))

    def finish() -> None:
        for pack, flat in after:
            if rop is ReduceOp.MEAN:
                flat.div_(dist.get_world_size(g))
            if pack.flat is not None:
                with torch.no_grad():
                    pack.copy_back(results)

    return _Launched(works, finish, target, timeout, results, single)


@functools.lru_cache(maxsize=512)
def _allreduce_options(kind: type[_AllreduceOpts], op: dist.ReduceOp.RedOpType, td: datetime.timedelta,
                       sync: bool) -> _AllreduceOpts:
    """A c10d options object, made once per distinct value: ``sync`` (async_op=False) lets the
    torchstrategies backend run the call on this thread."""
    opts = kind()
    opts.reduceOp = dist.ReduceOp(op)
    opts.timeout = td
    opts.asyncOp = not sync
    return opts


@functools.lru_cache(maxsize=512)
def _broadcast_options(root: int, td: datetime.timedelta) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.timeout = td
    opts.asyncOp = False
    return opts


@functools.lru_cache(maxsize=512)
def _allgather_options(td: datetime.timedelta) -> dist.distributed_c10d.AllgatherOptions:
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.timeout = td
    opts.asyncOp = False
    return opts


def _allreduce(target: Target, members: list[torch.Tensor], op: dist.ReduceOp.RedOpType, td: datetime.timedelta,
               sync: bool) -> dist.Work:
    if len(members) == 1:
        return target.obj.allreduce(members, _allreduce_options(dist.AllreduceOptions, op, td, sync))
    return target.obj.allreduce_coalesced(members, _allreduce_options(dist.AllreduceCoalescedOptions, op, td, sync))


def _reduce(what: str, tensors: TensorOrList, op: ReduceOp | str, group: dist.ProcessGroup | None,
            options: CommunicationOptions | None, inplace: bool) -> TensorOrList:
    call = _launch(what, tensors, op, group, options, inplace)
    for w in call.works:
        _wait(w, call.target, call.timeout, "all_reduce", group)
    call.finish()
    return call.result()


def all_reduce(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               options: CommunicationOptions | None = None) -> TensorOrList:
    """Returns the reduction of ``tensors`` over the group's ranks (new tensors; inputs untouched).

    Args:
        tensors: a Tensor or a list of Tensors (any shapes; mixed dtypes are reduced per dtype).
        op: ReduceOp SUM, MEAN, MIN or MAX (or its name).
        group: a torch.distributed group; None is the world.
        options: CommunicationOptions (implementation, bytes_per_pack, timeout_seconds).

    Returns:
        A Tensor if a Tensor was given, else a list in the same order.

    Raises:
        DeadlineExceededError: not every rank arrived within the timeout (a peer is late or frozen).
        UnavailableError: a peer is gone.
        ValueError / TypeError: bad input, or ranks making different calls.
    """
    return _reduce("all_reduce", tensors, op, group, options, False)


def all_reduce_(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                options: CommunicationOptions | None = None) -> TensorOrList:
    """Like ``all_reduce`` but writes the result into ``tensors`` and returns them."""
    return _reduce("all_reduce_", tensors, op, group, options, True)


def all_reduce_async(tensors: TensorOrList, op: ReduceOp | str = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                     options: CommunicationOptions | None = None) -> torch.futures.Future[TensorOrList]:
    """Starts an in-place all-reduce of ``tensors``; returns a ``torch.futures.Future``.

    The future (the type DDP's comm hooks return) gives what ``all_reduce_`` returns, or raises the
    collective's documented error. Calls on one group run in the order they were started, on the
    backend's own thread. Don't touch ``tensors`` until ``wait()`` returns.
    """
    call = _launch("all_reduce_async", tensors, op, group, options, True, sync=False)
    futs = [w.get_future() for w in call.works]
    result: torch.futures.Future[TensorOrList] = torch.futures.Future()

    def done(both: torch.futures.Future[list[torch.futures.Future[object]]]) -> None:
        try:
            for part in both.value():
                part.wait()
            call.finish()
        except Exception as exc:  # noqa: BLE001 - the documented error replaces the backend's
            result.set_exception(_translate(exc, call.target))  # type: ignore[arg-type]
            return
        result.set_result(call.result())

    torch.futures.collect_all(futs).add_done_callback(done)  # type: ignore[arg-type]
    return result


# ---------------------------------------------------------------------------------------- gather, broadcast
def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               options: CommunicationOptions | None = None, axis: int = 0) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` (same shape on all ranks) along ``axis``, in rank order."""
    items, _ = _as_list("all_gather", tensor)
    if len(items) != 1:
        raise TypeError("all_gather: expected one Tensor")
    t = items[0].contiguous()
    opts = _options("all_gather", options)
    timeout = _timeout(opts, group)
    target = _target(group, opts.implementation, t.is_cuda, timeout)
    if target.debug:
        debug.check("all_gather", None, [t], group, timeout)
    world = dist.get_world_size(group)
    out = torch.empty((world, *t.shape), dtype=t.dtype, device=t.device)
    gopts = _allgather_options(datetime.timedelta(seconds=timeout))
    _wait(target.obj._allgather_base(out.view(-1), t.view(-1), gopts), target, timeout, "all_gather", group)
    if t.dim() == 0:
        return out
    return torch.cat(list(out.unbind(0)), dim=axis)


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None,
              options: CommunicationOptions | None = None) -> torch.Tensor:
    """Copies group rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place) and returns it."""
    items, _ = _as_list("broadcast", tensor)
    t = items[0]
    ranks = topology.group_ranks(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(ranks):
        raise ValueError(f"broadcast: src {src} is not a rank of {topology.describe_group(group)}")
    opts = _options("broadcast", options)
    timeout = _timeout(opts, group)
    target = _target(group, opts.implementation, t.is_cuda, timeout)
    if target.debug:
        debug.check("broadcast", src, [t], group, timeout)
    work = t if t.is_contiguous() else t.contiguous()
    bopts = _broadcast_options(src, datetime.timedelta(seconds=timeout))
    _wait(target.obj.broadcast([work], bopts), target, timeout, "broadcast", group)
    if work is not t:
        t.copy_(work)
    return t


def buffer(numel: int, dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None,
           options: CommunicationOptions | None = None) -> torch.Tensor:
    """A zeroed 1-D tensor that the torchstrategies backend all-reduces in place without a copy in
    (collective; same numel and dtype on every rank).

    Where the group's plan has a shared-memory group on this host (SHM, HIERARCHICAL) the tensor lives in
    shared memory; otherwise it is an ordinary tensor. Gradient buckets use it.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"buffer: numel must be a non-negative int, got {numel!r}")
    opts = _options("buffer", options)
    if opts.implementation in (Impl.GLOO, Impl.NCCL):
        return torch.zeros(numel, dtype=dtype)
    target = _target(group, opts.implementation, False, _timeout(opts, group))
    try:
        out: torch.Tensor = _C.backend_buffer(target.obj, numel, torch.empty(0, dtype=dtype))
    except dist.DistBackendError as exc:
        raise from_backend_error(exc) from None
    return out
