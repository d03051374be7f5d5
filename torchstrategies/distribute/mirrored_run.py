"""Running a function once per local replica, with ``merge_call`` (TF's mirrored_run, eager).

As in TF, every replica has a thread of its own and the replicas run ONE AT A TIME, in replica order:
replica 0 in the thread that called ``strategy.run``, replicas 1..N-1 each on a persistent worker thread
(taken from a process-wide pool, never started per ``run``). The thread of replica 0 schedules:

* it runs ``fn`` for replica 0 until that reaches a ``merge_call`` (``optimizer.step()``,
  ``ReplicaContext.all_reduce``, SyncBatchNorm's statistics, ...) or returns;
* then it lets replica 1 run until it reaches its merge_call (or returns), then replica 2, and so on;
* when every replica waits in the merge_call, it folds the replicas' writes into the primaries
  (``replicated.py``), calls the merge function once in cross-replica context with the replicas'
  arguments grouped into PerReplica values, hands each replica its part of the result, and goes on with
  replica 0; when replica 0 returns, the others are run to their end the same way.

Before a replica runs, its view of the replicated tensors is swapped in (``ReplicaViews.enter``); the
cross-replica view is swapped back when it pauses. Every replica suspends the same way, whatever code
follows the merge_call. If some replicas return while others wait in a merge_call, the run raises
RuntimeError ("Some replicas made a different number of replica_context().merge_call() calls") instead of
hanging; the waiting replicas are stopped first. With ``merge_call_timeout`` set, a replica that neither
returns nor pauses within that many seconds becomes ``DeadlineExceededError`` (its thread is abandoned).

A replica's thread starts from the caller's torch thread-local state (grad mode, inference mode, autocast,
saved-tensor hooks, torch function/dispatch modes; ``_C.ThreadState``) and intra-op thread count, and its
CUDA device is the replica's. A replica's merge_call may also come from another thread acting for it
(``acting_for``: autograd running SyncBatchNorm's backward on a device thread while the replica waits in
``loss.backward()``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchstrategies._ext import _C
from torchstrategies.distribute.context import _Mode, pop_mode, push_mode
from torchstrategies.distribute.distribute_lib import ReplicaContext, Strategy
from torchstrategies.distribute.values import regroup, select_replica
from torchstrategies.errors import DeadlineExceededError

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.distribute.replicated import ReplicatedTensors

__all__ = ["acting_for", "call_for_each_replica", "current_replica", "merge_call", "replicas_running"]

_MISMATCH = "Some replicas made a different number of replica_context().merge_call() calls"
_MISMATCH_FN = "The replicas called replica_context().merge_call() with different functions"
_SYNC_HINT = (
    "every replica must make the same synchronizing calls, e.g. optimizer.step(), all_reduce, "
    "compute_average_loss without global_batch_size, SyncBatchNorm in training mode"
)
# Merge results every replica receives as they are (select_replica would return them unchanged).
_SHARED_RESULTS = frozenset({torch.Tensor, int, float, bool, str})


class _RequestedStop(BaseException):
    """Raised in a replica waiting in merge_call when its run ends without it (it unwinds ``fn``)."""


class _ThreadReplica(threading.local):
    replica: _Replica | None = None


_local = _ThreadReplica()  # the replica this thread runs
_acting = _ThreadReplica()  # the replica this thread communicates for (``acting_for``)
_running: list[_Run] = []  # the runs in progress in this process, innermost last (seen from every thread)


def replicas_running() -> int:
    """The number of replicas of the innermost in-process ``run`` in progress in this process (0: none).
    Unlike ``current_replica()`` it is seen from every thread, autograd's device threads included."""
    return len(_running[-1].devices) if _running else 0


def current_replica() -> _Replica | None:
    """The replica this thread runs (or acts for) now, of an in-process ``run`` (None: none, or a merge)."""
    return _acting.replica or _local.replica


@contextlib.contextmanager
def acting_for(replica: _Replica | None) -> Iterator[None]:
    """Lets this thread make merge_calls for ``replica`` (what ``current_replica()`` returned in it), e.g.
    autograd's device thread running SyncBatchNorm's backward while the replica waits in ``backward()``.

    Raises:
        RuntimeError: that replica's run is over.
    """
    if replica is not None and (replica.done or replica.run.over):
        raise RuntimeError(
            f"Replica {replica.index} has finished: cross-replica communication of a replica (e.g. "
            "SyncBatchNorm's backward) must happen inside strategy.run, while every replica runs"
        )
    previous = _acting.replica
    _acting.replica = replica
    try:
        yield
    finally:
        _acting.replica = previous


class _Worker(threading.Thread):
    """A persistent replica thread: runs its replica's ``fn`` whenever the scheduler resumes it, and hands
    back (``_C.Baton``: csrc/cpu/replica_threads.cpp) whenever that replica pauses in a merge_call or
    returns."""

    def __init__(self, number: int):
        super().__init__(name=f"torchstrategies-replica-{number}", daemon=True)
        self.baton = _C.Baton()
        self.replica: _Replica | None = None

    def run(self) -> None:
        self.baton.wait()
        while True:
            replica = self.replica
            if replica is not None:
                replica.execute()
            replica = None  # an idle thread keeps no run, hence no strategy, alive
            self.baton.pause()


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._count = 0

    def take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self._count += 1
            worker = _Worker(self._count)
        worker.start()
        return worker

    def give(self, worker: _Worker) -> None:
        worker.replica = None
        with self._lock:
            self._idle.append(worker)


_pool = _Pool()


class _Replica:
    """One replica's part of one ``run``: its function, its merge_call, its outcome."""

    def __init__(self, run: _Run, index: int, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.run = run
        self.index = index
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.result: object = None
        self.done = False
        self.exc: BaseException | None = None
        self.stop = False
        self.worker: _Worker | None = None
        self.merge: tuple[Callable[..., Any], tuple, dict] | None = None  # waiting in this merge_call
        self.merge_result: object = None

    def call(self) -> None:
        """Runs ``fn`` in this replica's context, on its device, in the current thread."""
        run = self.run
        device = run.devices[self.index]
        mode = run.modes[self.index]
        push_mode(mode)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self.result = self.fn(*self.args, **self.kwargs)
        finally:
            pop_mode(mode)

    def execute(self) -> None:
        """The worker thread's part: ``call`` with the caller's torch state entered."""
        _local.replica = self
        try:
            if torch.get_num_threads() != self.run.num_threads:
                torch.set_num_threads(self.run.num_threads)  # (OpenMP's thread count is per thread)
            self.run.state.call(self.call)
        except _RequestedStop:
            pass
        except BaseException as e:  # handed to the scheduling thread
            self.exc = e
        finally:
            _local.replica = None
            self.done = True


class _Run:
    """One ``call_for_each_replica``: its replicas, the replicated tensors' views, the first error."""

    def __init__(self, strategy: Strategy, replicated: ReplicatedTensors, timeout: float | None):
        ext = strategy.extended
        self.strategy = strategy
        self.devices = ext.worker_devices
        self.replicated = replicated
        self.views = replicated.views
        self.attributes = replicated.attributes
        self.timeout = timeout
        self.modes = _modes(strategy, len(self.devices))
        self.state = _C.ThreadState()
        self.num_threads = torch.get_num_threads()
        self.replicas: list[_Replica] = []
        self.error: BaseException | None = None
        self.over = False

    def enter(self, replica: int) -> None:
        """Replica ``replica``'s tensors and attributes in the modules (``ReplicaViews``, ``ReplicaAttributes``)."""
        self.views.enter(replica)
        self.attributes.enter(replica)

    def leave(self) -> None:
        """The cross-replica view of the modules back."""
        self.views.leave()
        self.attributes.leave()

    def fail(self, error: BaseException) -> BaseException:
        if self.error is None:
            self.error = error
        return self.error

    def sync(self) -> None:
        """Called for replica 0 when it waits in a merge_call or has returned: brings every other replica
        to the same point, folds, and (a merge_call) runs the merge; replica 0's view is back afterwards."""
        r0 = self.replicas[0]
        views = self.views
        self.leave()
        try:
            for r in self.replicas[1:]:
                if not r.done and r.merge is None:
                    self._resume(r)
            waiting = [r.index for r in self.replicas if r.merge is not None]
            if waiting and len(waiting) != len(self.replicas):
                raise self.fail(RuntimeError(self._mismatch()))
            self.replicated.fold(end=r0.done)
            if r0.merge is not None:
                self._merge()
        finally:
            if not r0.done:
                views.seed(False)  # what the merge wrote reaches every component
                self.enter(0)

    def _resume(self, r: _Replica) -> None:
        """Lets replica ``r`` (> 0) run on its worker until it pauses in a merge_call or returns."""
        w = r.worker
        if w is None:
            w = r.worker = _pool.take()
            w.replica = r
        self.enter(r.index)
        try:
            try:
                if not w.baton.resume(self.timeout):
                    raise self.fail(DeadlineExceededError(
                        f"Replica {r.index} neither finished nor reached merge_call within {self.timeout} s"
                    ))
            except BaseException:  # (also KeyboardInterrupt while it runs)
                r.worker = None  # it still runs its code: never reused
                raise
        finally:
            self.leave()
        if r.exc is not None:
            raise self.fail(r.exc)

    def _merge(self) -> None:
        """Calls the merge function once in cross-replica context; gives each replica its part."""
        replicas = self.replicas
        merge_fn, args, kwargs = replicas[0].merge  # type: ignore[misc]
        key = merge_key(merge_fn)
        for r in replicas[1:]:
            other = r.merge[0]  # type: ignore[index]
            if other is not merge_fn and merge_key(other) != key:
                raise self.fail(RuntimeError(
                    f"{_MISMATCH_FN}: replica 0 waits in merge_call({_name(merge_fn)}) while replica {r.index} "
                    f"waits in merge_call({_name(other)}) ({_SYNC_HINT}, in the same order)."
                ))
        if any(r.merge[1] or r.merge[2] for r in replicas):  # type: ignore[index]
            args = regroup([r.merge[1] for r in replicas])  # type: ignore[index]
            kwargs = regroup([r.merge[2] for r in replicas])  # type: ignore[index]
        for r in replicas:
            r.merge = None
        mode = self.modes[-1]
        local, acting = _local.replica, _acting.replica
        _local.replica = _acting.replica = None  # cross-replica context, even in a replica's thread
        push_mode(mode)
        try:
            result = merge_fn(self.strategy, *args, **kwargs)
        except BaseException as e:
            raise self.fail(e) from None
        finally:
            pop_mode(mode)
            _local.replica, _acting.replica = local, acting
        shared = len(replicas) == 1 or result is None or type(result) in _SHARED_RESULTS
        for i, r in enumerate(replicas):
            r.merge_result = result if shared else select_replica(i, result)

    def _mismatch(self) -> str:
        done = [r.index for r in self.replicas if r.merge is None]
        waiting = [r.index for r in self.replicas if r.merge is not None]
        name = _name(self.replicas[waiting[0]].merge[0])  # type: ignore[index]
        return (
            f"{_MISMATCH}: replicas {done} finished while replicas {waiting} wait in merge_call({name}) "
            f"({_SYNC_HINT})."
        )

    def finish(self) -> None:
        """Stops the replicas still waiting in a merge_call (they unwind their ``fn``) and gives the
        workers back. (A run that ended normally folded at replica 0's end, in ``sync``.)"""
        self.over = True
        self.leave()
        try:
            for r in self.replicas[1:]:
                if r.worker is None:
                    continue
                if not r.done:
                    r.stop = True
                    with contextlib.suppress(BaseException):
                        self._resume(r)
                if r.done and r.worker is not None:
                    _pool.give(r.worker)
        finally:
            self.views.end()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def merge_key(fn: Callable[..., Any]) -> object:
    """What makes two replicas' merge functions "the same": a key the wrapper gave it (an optimizer's
    step: that optimizer), a bound method's object and function, a partial's function, a plain function's
    module and qualified name (a lambda made anew by every replica is the same one), else its type."""
    key = getattr(fn, "_torchstrategies_merge_key", None)
    if key is not None:
        return key
    func = getattr(fn, "__func__", None)
    if func is not None:
        return (id(getattr(fn, "__self__", None)), func)
    if isinstance(fn, functools.partial):
        return ("partial", merge_key(fn.func))
    qualname = getattr(fn, "__qualname__", None)
    if qualname is not None:
        return (getattr(fn, "__module__", None), qualname)
    return type(fn)


def merge_call(replica: _Replica, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``replica``'s merge_call: waits until every replica made it and the merge ran; returns its part."""
    run = replica.run
    if run.error is not None:
        raise run.error
    replica.merge = (merge_fn, args, kwargs)
    if replica.index == 0:
        run.sync()
    else:
        w = replica.worker
        assert w is not None
        w.baton.pause()
        if replica.stop:
            raise _RequestedStop()
    if run.error is not None:
        raise run.error
    result, replica.merge_result = replica.merge_result, None
    return result


def call_for_each_replica(
    strategy: Strategy,
    fn: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    replicated: ReplicatedTensors,
    timeout: float | None,
) -> Any:
    """Runs ``fn`` once per local replica (see the module docstring); regroups the results.

    Args:
        replicated: the strategy's ``ReplicatedTensors`` (refreshed by the caller).
        timeout: None, or seconds replica 1..N-1 may run before it returns or pauses.

    Raises:
        RuntimeError: replicas made different numbers of merge_calls.
        DeadlineExceededError: a replica neither returned nor paused within ``timeout`` seconds.
        Any exception a replica or a merge function raised.
    """
    run = _Run(strategy, replicated, timeout)
    n = len(run.devices)
    per_replica = [select_replica(i, (args, kwargs)) for i in range(n)]
    run.replicas = replicas = [_Replica(run, i, fn, a, k) for i, (a, k) in enumerate(per_replica)]
    r0 = replicas[0]
    previous = _local.replica
    _local.replica = r0
    _running.append(run)
    try:
        run.views.begin()  # holds the replicated tensors; seeds every component (whatever cross-replica
        run.attributes.begin()  # code did since the last run)
        run.enter(0)
        try:
            run.state.call(r0.call)  # (as on the workers: what fn does to torch's modes stays in it)
        finally:
            r0.done = True
        run.sync()
        if run.error is not None:  # raised in replica 0, which caught it
            raise run.error
    finally:
        _local.replica = previous
        _running.remove(run)
        run.finish()
    run.replicas = []
    results = [r.result for r in replicas]
    return regroup(results) if any(r is not None for r in results) else None


def _modes(strategy: Strategy, n: int) -> list[_Mode]:
    """The context modes of ``strategy``'s ``n`` local replicas, then its cross-replica mode, made once per
    strategy (a ReplicaContext holds nothing of one run, so the same one serves every run)."""
    ext = strategy.extended
    modes: list[_Mode] | None = getattr(ext, "_replica_modes", None)
    if modes is None or len(modes) != n + 1:
        offset = ext._replica_id_offset
        modes = [_Mode(strategy, ReplicaContext(strategy, offset + i, i), None, False) for i in range(n)]
        modes.append(_Mode(strategy, None, strategy, False))
        ext._replica_modes = modes
    return modes

