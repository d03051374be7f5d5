"""Running a function once per local replica, with ``merge_call`` (TF's mirrored_run).

As in TF, the replicas run ONE AT A TIME, in replica order, and every replica must make the same
synchronizing calls (``merge_call``: ``optimizer.step()``, ``ReplicaContext.all_reduce``, SyncBatchNorm's
statistics, ``compute_average_loss`` without a batch size, GradScaler's inf check). The scheduler:

* Replica 0 runs in the CALLING thread. If it finishes ``fn`` without a merge_call, no replica needs a
  thread: replicas 1..N-1 run after it, one by one, in the calling thread too (no thread hand-over at
  all). One of them that does call merge_call is a mismatch and raises RuntimeError naming the replica
  and the merge function.
* A merge_call that ends ``fn`` (nothing of the replica runs after it: ``optimizer.step()`` as the last
  statement, or followed by ``return <local>``; see ``_frames.replica_fn_check``) returns at once for
  every replica but the last to arrive, so they all run in the calling thread; the last one runs the
  merge function (with every replica's arguments) in that thread. Seen from the replicas and the
  result, this is the schedule below without its thread hand-overs. A replica that then finishes
  without that merge_call makes the run raise the mismatch RuntimeError. A replica k > 0 whose
  merge_call does not end ``fn`` waits in the calling thread while replicas k+1.. run on workers, as
  replica 0 does below.
* If replica 0 calls merge_call otherwise, replicas 1..N-1 run on persistent worker threads (taken from a
  process-wide pool, never started per ``run``): inside replica 0's merge_call the calling thread lets
  replica 1 run until it pauses in its merge_call, then replica 2, and so on; it then calls the merge
  function once in cross-replica context with the replicas' arguments grouped into PerReplica values,
  hands each replica its component of the result and goes on with replica 0. When replica 0 finishes (or
  reaches its next merge_call) the workers are resumed in order the same way.
* With ``merge_call_timeout`` set, every replica runs on a worker thread (the calling thread only
  schedules), so a replica that neither finishes nor pauses within the timeout becomes
  ``DeadlineExceededError``.

Running one at a time makes the result deterministic, the per-replica state thread-safe, and lets the
scheduler swap each replica's view of the parameters in and out (``replicated.ReplicaSlots``) at every
hand-over (between two replicas in the calling thread, in one pass: ``ReplicaSlots.hand_over``). Each
replica's ReplicaContext (and its context mode) is made once per strategy and serves every run. If some
replicas finish while others wait in merge_call, a RuntimeError is raised ("Some replicas made a different
number of replica_context().merge_call() calls") instead of hanging.

The caller's thread-local torch state (grad mode, inference mode, autocast per device type, intra-op
thread count) is what replicas in the calling thread see anyway; it is entered around ``fn`` on every
worker. A replica's communication may also be made from another thread on its behalf (``acting_for``:
autograd running SyncBatchNorm's backward on a device thread while the replica waits in ``backward()``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchstrategies.distribute._frames import replica_fn_check
from torchstrategies.distribute.context import _Mode, mode_stack, pop_mode, push_mode
from torchstrategies.distribute.distribute_lib import ReplicaContext
from torchstrategies.distribute.values import DistributedValues, PerReplica, _nested, regroup, select_replica
from torchstrategies.errors import DeadlineExceededError

__all__ = [
    "acting_for",
    "capture_replica_thread",
    "current_replica",
    "call_for_each_replica",
    "merge_call_in_replica_thread",
    "in_replica_thread",
    "TorchState",
]

# torch.set_grad_enabled(mode) as a plain call (the context manager's constructor reads the mode first)
_set_grad_enabled = torch._C._set_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled

_MISMATCH = "Some replicas made a different number of replica_context().merge_call() calls"
_SYNC_HINT = (
    "every replica must make the same synchronizing calls, e.g. optimizer.step(), all_reduce, "
    "compute_average_loss without global_batch_size, SyncBatchNorm in training mode"
)


# Merge results every replica receives as they are (select_replica would return them unchanged).
_SHARED_RESULTS = frozenset({torch.Tensor, int, float, bool, str})


class _RequestedStop(Exception):
    pass


class TorchState:
    """The caller's thread-local torch modes that replicas inherit (grad, inference, autocast, threads)."""

    __slots__ = ("grad", "inference", "autocast", "cache", "num_threads", "simple")

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast: tuple[tuple[str, torch.dtype], ...] = ()
        if _any_autocast():
            self.autocast = tuple(
                (dt, torch.get_autocast_dtype(dt)) for dt in ("cpu", "cuda") if torch.is_autocast_enabled(dt)
            )
        self.cache = torch.is_autocast_cache_enabled()
        self.num_threads = torch.get_num_threads()
        self.simple = not self.inference and not self.autocast

    def enter(self, stack: contextlib.ExitStack) -> None:
        """Enters these modes in the current thread (until ``stack`` closes)."""
        if self.num_threads > 0 and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)  # OpenMP's thread count is per thread
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for dt, dtype in self.autocast:
            stack.enter_context(torch.autocast(dt, dtype=dtype, cache_enabled=self.cache))


def _replica_modes(strategy: Any, n: int) -> list[_Mode]:
    """The replica-context modes of ``strategy``'s ``n`` local replicas, then its cross-replica mode (index
    ``n``, for merge functions), kept on its extended: a ReplicaContext holds nothing of one run, so the
    same one serves every run (as the same replica)."""
    ext = strategy._extended
    offset = ext._replica_id_offset
    modes: list[_Mode] | None = getattr(ext, "_replica_modes", None)
    if (
        modes is None
        or len(modes) != n + 1
        or modes[0].strategy is not strategy
        or modes[0].replica_context._replica_id_in_sync_group != offset  # type: ignore[union-attr]
    ):
        modes = [
            _Mode(strategy, ReplicaContext(strategy, offset + i, i), None, ext._is_default) for i in range(n)
        ]
        modes.append(_Mode(strategy, None, strategy, False))
        ext._replica_modes = modes
    return modes


def _merge_name(merge_fn: Any) -> str:
    return getattr(merge_fn, "__qualname__", None) or repr(merge_fn)


class _Run:
    """One ``call_for_each_replica``: its replicas, their workers, the slots and the first error."""

    # What a run starts with: class attributes, until the run sets its own (one store less each per run).
    threaded = False  # replicas 1..n-1 run on workers (replica 0 reached a merge_call)
    error: BaseException | None = None  # raised by every later merge_call and by the run
    over = False
    arrived = 0  # replicas waiting in the current merge_call
    deferred = 0  # of those, replicas whose fn ended after it (their merge_call returned early)
    workers: list[_Worker | None] | None = None  # worker i (taken at replica i's first turn on a thread)
    idle: list[bool] | None = None  # whether worker i is waiting (not inside its replica's code)

    def __init__(self, strategy: Any, n: int, slots: Any, ts: TorchState):
        self.strategy = strategy
        self.n = n
        self.slots = slots
        self.ts = ts
        self.modes = _replica_modes(strategy, n)  # replica i's context, then the merge's (made once per strategy)
        self.replicas: list[_Replica] = []

    def fail(self, error: BaseException) -> BaseException:
        if self.error is None:
            self.error = error
        return self.error


class _Replica:
    """One replica's part of one ``run``: its function, its merge_call hand-over, its outcome."""

    # What a replica starts with: class attributes, until the run sets its own (one store less each per run).
    worker: _Worker | None = None
    result: Any = None
    done = False
    exc: BaseException | None = None
    stop = False
    merge_fn: Callable[..., Any] | None = None
    merge_args: tuple = ()
    merge_kwargs: dict = {}  # (only ever replaced, never mutated)  # noqa: RUF012
    merge_result: Any = None
    waiting = False  # arrived at a merge_call that has not run yet

    kwargs: dict = {}  # (only ever replaced, never mutated)  # noqa: RUF012

    def __init__(self, run: _Run, index: int, fn: Callable[..., Any], args: tuple, kwargs: dict | None = None):
        self.run = run
        self.index = index
        self.fn, self.args = fn, args
        if kwargs:
            self.kwargs = kwargs

    def call(self) -> None:
        """Runs ``fn`` in this replica's context in the current thread (whose torch state is set)."""
        mode = self.run.modes[self.index]
        push_mode(mode)
        try:
            self.result = self.fn(*self.args, **self.kwargs)
        finally:
            pop_mode(mode)
        self.done = True

    def execute(self) -> None:
        """The worker-thread body: the caller's torch state entered around ``call``."""
        _local.replica = self
        try:
            if self.stop:
                return
            ts = self.run.ts
            if ts.simple:  # only grad mode to carry: no ExitStack
                _set_grad_enabled(ts.grad)
                if ts.num_threads > 0 and torch.get_num_threads() != ts.num_threads:
                    torch.set_num_threads(ts.num_threads)
                self.call()
            else:
                with contextlib.ExitStack() as stack:
                    ts.enter(stack)
                    self.call()
        except _RequestedStop:
            pass
        except BaseException as e:  # handed to the scheduling thread
            self.exc = e
        finally:
            _local.replica = None


class _Worker(threading.Thread):
    """A persistent replica thread: waits for ``go``, runs its replica until it pauses or ends, signals
    ``back``."""

    def __init__(self, number: int):
        super().__init__(name=f"torchstrategies-replica-worker-{number}", daemon=True)
        self.go = threading.Lock()
        self.go.acquire()
        self.back = threading.Lock()
        self.back.acquire()
        self.replica: _Replica | None = None
        self.exit = False

    def run(self) -> None:
        while True:
            self.go.acquire()
            if self.exit:
                return
            replica = self.replica
            if replica is not None:
                replica.execute()
            self.back.release()

    def resume(self, timeout: float | None) -> bool:
        """Lets the worker run until it pauses or finishes; False if it did neither within ``timeout``."""
        self.go.release()
        return self.back.acquire(timeout=-1 if timeout is None else timeout)


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
            w = _Worker(self._count)
        w.start()
        return w

    def give(self, workers: list[_Worker]) -> None:
        with self._lock:
            self._idle.extend(workers)


_pool = _Pool()

class _ThreadReplica(threading.local):
    replica: _Replica | None = None  # (a class default: reading it in a fresh thread raises nothing)


_local = _ThreadReplica()  # .replica: the replica this thread runs now (calling thread or worker)
_acting = _ThreadReplica()  # .replica: the replica this thread communicates for (``acting_for``)


@contextlib.contextmanager
def acting_for(replica: Any) -> Iterator[None]:
    """Lets this thread make merge_calls for ``replica``, blocked meanwhile (e.g. in ``loss.backward()``
    while autograd runs a node on its CUDA device thread). A no-op unless ``replica`` is what
    ``capture_replica_thread`` returned inside a replica of a running ``run``.

    Raises:
        RuntimeError: that replica has finished (its ``run`` is over).
    """
    previous = _acting.replica
    if isinstance(replica, _Replica):
        if replica.done or replica.stop or replica.run.over:
            raise RuntimeError(
                f"Replica {replica.index} has finished: cross-replica communication of a replica (e.g. "
                "SyncBatchNorm's backward) must happen inside strategy.run, while every replica runs"
            )
        _acting.replica = replica
    else:
        _acting.replica = None
    try:
        yield
    finally:
        _acting.replica = previous


def capture_replica_thread() -> Any:
    """What ``acting_for`` needs to act for the replica running in this thread now (the thread itself
    when it runs no replica of an in-process strategy)."""
    r = _local.replica
    return r if r is not None else threading.current_thread()


def current_replica() -> _Replica | None:
    """The replica this thread runs (or acts for) now, of an in-process ``run`` (None: none, or in a merge)."""
    return _acting.replica or _local.replica



def in_replica_thread() -> bool:
    """Whether this thread runs (or acts for) a replica of an in-process ``run`` now (not its merge)."""
    return current_replica() is not None


def merge_call_in_replica_thread(
    merge_fn: Callable[..., Any], args: tuple, kwargs: dict, replica: _Replica | None = None
) -> Any:
    """Pauses this replica until every replica reached its merge_call and the merge ran; returns our part.

    The replica that arrives last runs the merge function itself (in cross-replica context) and goes on
    without a hand-over; the others wait for it. ``replica``: ``current_replica()`` when the caller has it.
    """
    r = replica if replica is not None else current_replica()
    assert r is not None
    run = r.run
    if run.error is not None:
        raise run.error
    if not run.threaded and r.index != 0 and not run.deferred:
        # in the calling thread after replica 0 finished without one
        raise run.fail(
            RuntimeError(
                f"{_MISMATCH}: replica {r.index} called merge_call({_merge_name(merge_fn)}) but replica 0 "
                f"finished without any ({_SYNC_HINT})."
            )
        )
    r.merge_fn, r.merge_args, r.merge_kwargs = merge_fn, args, kwargs
    r.waiting = True
    run.arrived += 1
    inline = r.worker is None and _acting.replica is None  # fn's own frames are above
    if run.arrived == run.n:
        # The replica view comes back after the merge unless nothing of fn runs after it.
        _merge_here(run, r, not (inline and _ends_replica_fn(r.fn, sys._getframe(1))))
        return r.merge_result
    if not run.threaded and inline and _ends_replica_fn(r.fn, sys._getframe(1)):
        # Nothing of fn runs after this merge_call and its result is dropped: fn may end now, and the
        # merge runs when the last replica arrives, in this thread, with no worker thread at all.
        run.deferred += 1
        return None
    run.threaded = True
    w = r.worker
    if w is not None:  # on a worker: hand control back to the scheduling thread until the merge ran
        grad = torch.is_grad_enabled()
        w.back.release()
        w.go.acquire()
        _set_grad_enabled(grad)
        if r.stop:
            raise _RequestedStop()
        return r.merge_result
    # Replica 0 in the calling thread (or a thread acting for it): the workers run until one merged.
    slots = run.slots
    grad = torch.is_grad_enabled()
    if slots is not None:
        slots.deactivate()
    try:
        for i in range(r.index + 1, run.n):  # the replicas before r finished (their merge_calls deferred)
            ri = run.replicas[i]
            if ri.done:
                break  # finished without this merge_call: a mismatch
            if not ri.waiting:
                _resume(run, i, None)
            if not r.waiting:
                break  # merged (by replica i); the rest go on after replica 0
        if r.waiting:
            raise run.fail(RuntimeError(_count_mismatch(run)))
    except BaseException as e:
        run.fail(e)
        raise
    finally:
        if slots is not None:
            slots.activate(r.index)
        _set_grad_enabled(grad)
    return r.merge_result


def _merge_here(run: _Run, r: _Replica, reactivate: bool) -> None:
    """The last replica to arrive runs the merge in its own thread (its replica view swapped out, and in
    again afterwards when ``reactivate``)."""
    slots = run.slots
    if slots is not None:
        slots.deactivate()
    try:
        _merge(run)
    except BaseException as e:
        raise run.fail(e) from None
    finally:
        if slots is not None and reactivate:
            slots.activate(r.index)


def _count_mismatch(run: _Run) -> str:
    done = [r.index for r in run.replicas if r.done and not r.waiting]
    waiting = [r.index for r in run.replicas if r.waiting]
    merge = _merge_name(run.replicas[waiting[0]].merge_fn) if waiting else "?"
    return (
        f"{_MISMATCH}: replicas {done} finished while replicas {waiting} wait in merge_call({merge}) "
        f"({_SYNC_HINT})."
    )


def _resume(run: _Run, i: int, timeout: float | None) -> _Replica:
    """Lets replica ``i`` run on its worker (taken from the pool at its first turn) until it pauses or
    ends; raises what it (or a merge it ran) raised."""
    r = run.replicas[i]
    if run.workers is None:
        run.workers = [None] * run.n
        run.idle = [True] * run.n
    w = run.workers[i]
    if w is None:
        w = run.workers[i] = _pool.take()
        w.replica = r
        r.worker = w
    slots = run.slots
    if slots is not None:
        slots.activate(i)
    idle = run.idle
    assert idle is not None
    try:
        idle[i] = False
        if not w.resume(timeout):
            raise DeadlineExceededError(
                f"Replica {i} neither finished nor reached merge_call within {timeout} s"
            )
        idle[i] = True
    finally:
        if slots is not None:
            slots.deactivate()
    if run.error is not None:
        raise run.error
    if r.exc is not None:
        raise run.fail(r.exc)
    return r


def _merge(run: _Run) -> None:
    """Calls the merge function once in cross-replica context; gives each replica its part."""
    replicas = run.replicas
    strategy = run.strategy
    run.arrived = 0
    run.deferred = 0
    if run.slots is not None and run.slots.buffers_dirty:
        run.slots.fold_buffers()
    merge_args: Any = ()
    merge_kwargs: Any = {}
    for r in replicas:
        if r.merge_args or r.merge_kwargs:  # (optimizer.step() has nothing to regroup)
            merge_args = regroup([q.merge_args for q in replicas])
            merge_kwargs = regroup([q.merge_kwargs for q in replicas])
            break
    mode = run.modes[run.n]  # cross-replica context
    local, acting = _local.replica, _acting.replica
    _local.replica = _acting.replica = None  # cross-replica context, even in a replica's thread
    grad = torch.is_grad_enabled()
    _set_grad_enabled(run.ts.grad)  # the caller's grad mode, as if the merge ran in its thread
    stack = mode_stack()
    stack.append(mode)  # (push_mode)
    try:
        merge_fn = replicas[0].merge_fn
        assert merge_fn is not None
        result = merge_fn(strategy, *merge_args, **merge_kwargs)
    finally:
        if stack and stack[-1] is mode:
            stack.pop()
        else:
            pop_mode(mode)  # (raises: the merge function left a context open)
        _set_grad_enabled(grad)
        _local.replica, _acting.replica = local, acting
    single = run.n == 1 or result is None or type(result) in _SHARED_RESULTS
    for i, r in enumerate(replicas):
        r.merge_result = result if single else select_replica(i, result)
        r.merge_fn, r.merge_args, r.merge_kwargs, r.waiting = None, (), {}, False


def call_for_each_replica(
    strategy: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    timeout: float | None = None,
    slots: Any = None,
) -> Any:
    """Runs ``fn`` once per local replica (one at a time, see the module docstring); regroups the results.

    Args:
        slots: a ``ReplicaSlots`` whose replica view is swapped in around each replica's turn, or None.
        timeout: None, or seconds a replica may run before it finishes or pauses (every replica then runs
            on a worker thread).

    Raises:
        RuntimeError: replicas made different numbers of merge_calls.
        DeadlineExceededError: a replica neither finished nor paused within ``timeout`` seconds.
        Any exception a replica or a merge function raised.
    """
    n = len(strategy._extended._worker_devices)  # the local replicas
    run = _Run(strategy, n, slots, TorchState())
    per_replica = _flat_arguments(args, kwargs, n)
    if per_replica is not None:
        run.replicas = [_Replica(run, i, fn, per_replica[i]) for i in range(n)]
    else:
        run.replicas = [_Replica(run, i, fn, *select_replica(i, (args, kwargs))) for i in range(n)]
    if timeout is not None:
        return _run_on_workers(run, timeout)
    grad = run.ts.grad
    previous = _local.replica
    modes = run.modes
    stack = mode_stack()  # (push_mode / pop_mode, inline)
    try:
        for r in run.replicas:
            i = r.index
            if i == 0 or not run.threaded:  # in this thread, its slots view swapped in around it
                if i:
                    _set_grad_enabled(grad)  # what replica 0 left behind does not reach replica i
                _local.replica = r
                if slots is not None and slots.active_index != i:  # (handed over by replica i-1)
                    slots.activate(i)
                mode = modes[i]
                stack.append(mode)
                try:  # (what r.call() does; inline, as ``_ends_replica_fn`` expects: fn called from here)
                    r.result = fn(*r.args, **r.kwargs)
                except BaseException:
                    pop_mode(mode)
                    if slots is not None:
                        slots.deactivate()
                    _local.replica = previous
                    if run.error is not None:
                        raise run.error from None
                    raise
                if stack[-1] is mode:
                    stack.pop()
                else:
                    pop_mode(mode)  # (raises: fn left a context open)
                r.done = True
                if slots is not None:
                    if i + 1 < n and not run.threaded:
                        slots.hand_over(i + 1)  # replica i's view out, replica i+1's in, in one pass
                    elif slots.active_index is not None:  # (not after a merge that ended fn)
                        slots.deactivate()
                _local.replica = previous
            elif not r.done:
                if r.waiting:  # it went on to a merge_call that replica 0 never made
                    raise run.fail(RuntimeError(_count_mismatch(run)))
                if not _resume(run, i, None).done:
                    raise run.fail(RuntimeError(_count_mismatch(run)))
            if run.error is not None:  # a replica caught it: still the run's error
                raise run.error
        if run.arrived:  # deferred merge_calls that not every replica made
            raise run.fail(RuntimeError(_count_mismatch(run)))
    finally:
        run.over = True
        _set_grad_enabled(grad)
        if run.threaded:
            _finish(run)
        if slots is not None:
            if slots.active_index is not None:
                slots.deactivate()  # (replica i+1's view, handed over before an error stopped the run)
            if slots.buffers_dirty:
                slots.fold_buffers()
    return _results(run)


def _results(run: _Run) -> Any:
    """The replicas' results, regrouped; the run lets go of its replicas (each holds the run: no cycle is
    left for the garbage collector, which a cycle per step would make run every few steps)."""
    replicas = run.replicas
    run.replicas = []
    results = [r.result for r in replicas]
    if results[0] is None and results.count(None) == len(results):
        return None  # (what regroup returns, without its walk)
    return regroup(results)


# Whether a merge_call is the last act of a replica function that call_for_each_replica called in its own
# thread (distribute/_frames.py): then the replica may end at once, and the merge run when the last replica
# arrives (no worker thread).
_ends_replica_fn = replica_fn_check(call_for_each_replica.__code__)


def _flat_arguments(args: Any, kwargs: Any, n: int) -> list[tuple] | None:
    """Each replica's positional arguments when there are no keyword arguments and no argument is a
    container (a DistributedValues gives each replica its component, anything else is shared); None
    otherwise (``select_replica`` walks the structure)."""
    if type(args) is not tuple or type(kwargs) is not dict or kwargs:
        return None
    columns = []
    for a in args:
        if type(a) is PerReplica and len(a._values) == n:  # the usual: a distributed batch
            columns.append(a._values)
        elif isinstance(a, DistributedValues) or _nested(a):
            return None  # (one of another size raises in select_replica; a container is walked)
        else:
            columns.append((a,) * n)
    return list(zip(*columns, strict=True)) if columns else [()] * n


def _run_on_workers(run: _Run, timeout: float | None) -> Any:
    """Every replica on a worker thread; the calling thread schedules (``timeout`` applies)."""
    replicas = run.replicas
    run.threaded = True
    try:
        while True:
            progressed = False
            for i in range(run.n):
                r = replicas[i]
                if not r.done and not r.waiting:
                    _resume(run, i, timeout)
                    progressed = True
            if all(r.done for r in replicas):
                break
            if not progressed:  # every replica finished or waits for one that finished
                raise run.fail(RuntimeError(_count_mismatch(run)))
    finally:
        run.over = True
        _finish(run)
        if run.slots is not None:
            run.slots.fold_buffers()
    return _results(run)


def _finish(run: _Run) -> None:
    """Stops replicas still paused in merge_call and returns the workers that are idle to the pool."""
    back = []
    if run.workers is None or run.idle is None:
        return  # no replica ran on a worker
    for i, w in enumerate(run.workers):
        if w is None or not run.idle[i]:
            continue  # never taken, or still running past a deadline: never reused
        r = run.replicas[i]
        if not r.done and r.exc is None:  # paused in a merge_call, or never started
            r.stop = True
            if not w.resume(1.0):
                continue
        w.replica = None
        back.append(w)
    _pool.give(back)
