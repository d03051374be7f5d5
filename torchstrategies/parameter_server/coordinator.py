"""``ClusterCoordinator``: schedules functions on idle workers (``tf.distribute.coordinator.ClusterCoordinator``).

One thread per worker takes closures from the queue and runs them on its worker over that worker's own
channel. A worker that dies (its channel breaks) or freezes (it misses a heartbeat: no answer within the
strategy's ``heartbeat_timeout``) has its in-flight closure put back in the queue for another worker, so a
closure may run more than once; when the worker's task comes back (it publishes a new address), the
strategy's heartbeat loop finds it (the one path that looks) and the coordinator reconnects to it. Which
instance of a worker is current is the strategy's
:class:`~torchstrategies.parameter_server.worker_links.WorkerLink`: the coordinator runs closures only on the
instance that the link (and so the heartbeats) follows, and abandons a call when that instance is found dead.
A ps that dies makes ``schedule``/``join``/``done`` raise
:class:`~torchstrategies.errors.UnavailableError` (within the strategy's timeout), as does losing every worker
for longer than the timeout.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from torchstrategies.errors import CancelledError, DeadlineExceededError, UnavailableError
from torchstrategies.parameter_server.closure_queue import ClosureQueue
from torchstrategies.parameter_server.per_worker_input import (
    PerWorkerDataset,
    PerWorkerDatasetIterator,
    PerWorkerInputContext,
    dataset_fn_for_workers,
)
from torchstrategies.parameter_server.remote_value import PerWorkerValues, RemoteValue, RemoteValueStatus
from torchstrategies.parameter_server.rpc.client import RpcClient
from torchstrategies.parameter_server.rpc.transport import RemoteError
from torchstrategies.parameter_server.strategy import ParameterServerStrategy
from torchstrategies.parameter_server.worker_links import WorkerInstance

# What ``ts.coordinator`` exports (tf.distribute.coordinator's names): the one list of them.
__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerInputContext",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
]

log = logging.getLogger("torchstrategies.parameter_server")


class _Closure:
    def __init__(self, blob: bytes, refs: set, pwv: list[PerWorkerValues]):
        self.blob = blob
        self.refs = refs
        self.pwv = pwv
        self.remote_value = RemoteValue()

    def mark_cancelled(self) -> None:
        self.remote_value._mark_cancelled()


class _Abort:
    """What cancels a call in flight on a worker: its instance found dead, or the coordinator stopping."""

    def __init__(self, dead: threading.Event, stopping: threading.Event):
        self._dead = dead
        self._stopping = stopping

    def is_set(self) -> bool:
        return self._dead.is_set() or self._stopping.is_set()


class _WorkerHandle:
    def __init__(self, coordinator: ClusterCoordinator, index: int):
        self.c = coordinator
        self.index = index
        self.link = coordinator.strategy._workers[index]
        self.conn: tuple[RpcClient, WorkerInstance] | None = None   # the work channel, and its instance
        self.on: WorkerInstance | None = None   # the instance last connected to
        self.sent: set = set()
        self.pulled_bytes = 0
        self.pushed_bytes = 0
        self.closures_run = 0
        self.thread = threading.Thread(target=self._loop, name=f"ps-worker-{index}", daemon=True)

    def _loop(self) -> None:
        q = self.c._queue
        while not self.c._stopped:
            if self.conn is None:
                self._connect()
                continue                        # connected: the next pass takes a closure
            client, on = self.conn
            if on.dead.is_set() or client.broken:
                on.mark_dead("its work channel broke")
                client.close()                  # dead or frozen: wait for the task to come back
                self.conn = None
                q.set_live(self.index, False)
                self.c._worker_lost_at(self.index)
                continue
            closure = q.get(self.index)
            if closure is None:
                continue
            self._process(closure, client, on)

    def _connect(self) -> bool:
        """Sets up the work channel to the worker's live instance, once the heartbeat loop moved its link
        to one this thread has not used (it waits up to 0.5 s for that, so a stop is seen soon)."""
        s = self.c.strategy
        on = self.link.wait_live(self.on, 0.5)
        if on is None:
            return False                        # not back yet
        try:
            client = s._connect_worker(self.index, on.address, on.instance)
        except (UnavailableError, DeadlineExceededError, RemoteError) as exc:
            on.mark_dead(f"its set-up failed: {exc}")
            return False
        self.conn, self.on, self.sent = (client, on), on, set()
        self.c._queue.set_live(self.index, True)
        return True

    def _process(self, closure: _Closure, client: RpcClient, on: WorkerInstance) -> None:
        q = self.c._queue
        try:
            header = {
                "op": "exec",
                "closure": closure.blob,
                "defs": pickle.dumps(self.c._registry.defs_for(closure.refs, self.sent)),
                "pwv": [self.c._registry.dumps(v._values[self.index])[0] for v in closure.pwv],
            }
        except BaseException as exc:  # noqa: BLE001 - a closure that cannot be sent fails like one that raised
            closure.remote_value._set_error(exc)
            q.mark_failed(exc)
            return
        try:
            reply, _ = client.call(header, timeout=None, abort=_Abort(on.dead, self.c._stopping))
        except (UnavailableError, DeadlineExceededError, CancelledError) as exc:
            if self.c._stopped:
                closure.mark_cancelled()
                return
            on.mark_dead(f"failed while running a closure ({exc}); the closure is re-queued")
            q.put_back(closure)
            return
        except RemoteError as e:
            remote = e.exc
            if e.reply.get("exc") is not None:   # the closure's own exception, from a worker we authenticated
                try:
                    remote = pickle.loads(e.reply["exc"])
                except Exception:  # noqa: BLE001 - keep the rebuilt one
                    pass
            if isinstance(remote, (UnavailableError, DeadlineExceededError)):
                msg = f"a parameter server became unavailable while worker:{self.index} ran a closure: {remote}"
                self.c.strategy._ps_failed(msg)
                err = UnavailableError(msg)
                closure.remote_value._set_error(err)
                q.mark_failed(err)
                return
            try:
                remote.add_note(f"(raised by the scheduled function on worker:{self.index}; "  # type: ignore[attr-defined]
                                f"remote traceback:\n{e.text})")
            except AttributeError:
                pass
            closure.remote_value._set_error(remote)
            q.mark_failed(remote)
            return
        try:
            value = pickle.loads(reply["result"])
        except BaseException as exc:  # noqa: BLE001
            closure.remote_value._set_error(exc)
            q.mark_failed(exc)
            return
        self.pulled_bytes = reply.get("pulled_bytes", self.pulled_bytes)
        self.pushed_bytes = reply.get("pushed_bytes", self.pushed_bytes)
        self.closures_run += 1
        self.c._registry.dirty = True
        closure.remote_value._set_value(value)
        q.mark_finished(self.index)


class ClusterCoordinator:
    """Schedules functions on the workers of a :class:`ParameterServerStrategy` cluster.

    Args:
        strategy: the ParameterServerStrategy (one coordinator per strategy; constructing another returns
            the same object, as in TF).

    Example:
        >>> coordinator = ts.coordinator.ClusterCoordinator(strategy)          # doctest: +SKIP
        >>> per_worker_iter = iter(coordinator.create_per_worker_dataset(dataset_fn))  # doctest: +SKIP
        >>> for _ in range(100):                                                # doctest: +SKIP
        ...     loss = coordinator.schedule(train_step, args=(per_worker_iter,))
        >>> coordinator.join(); print(loss.fetch())                             # doctest: +SKIP
    """

    def __new__(cls, strategy):
        existing = getattr(strategy, "_cluster_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy):
        if getattr(self, "_initialized", False):
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError(f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}")
        self._initialized = True
        self.strategy = strategy
        strategy._cluster_coordinator = self
        self._registry = strategy._registry
        self._stopped = False
        self._stopping = threading.Event()
        n = strategy._num_workers
        self._queue = ClosureQueue(n, strategy._max_staleness)
        self._lost_since: dict[int, float] = {}
        self._workers = [_WorkerHandle(self, i) for i in range(n)]
        if strategy._fatal is not None:
            self._queue.set_fatal(strategy._fatal)
        for w in self._workers:
            w.thread.start()

    # ---- public API ----------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: tuple | list | None = None, kwargs: dict | None = None) -> RemoteValue:
        """Schedules ``fn(*args, **kwargs)`` to run on some worker; returns its :class:`RemoteValue` at once.

        Raises:
            ValueError: ``fn`` is not callable, or an argument cannot be sent (e.g. a RemoteValue).
            UnavailableError: a parameter server is gone.
            Exception: the error of an earlier scheduled function that failed (raised once).
        """
        if not callable(fn):
            raise ValueError(f"the function passed to schedule must be callable, got {fn!r}")
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        self._check_health()
        reg = self._registry
        reg.push_chief_assignments()
        reg.push_hyperparameters()
        blob, refs, pwv = reg.dumps_closure(fn, args, kwargs)
        closure = _Closure(blob, refs, pwv)
        self._queue.put(closure)
        return closure.remote_value

    def join(self) -> None:
        """Blocks until every scheduled function has finished.

        Raises:
            UnavailableError: a parameter server is gone (or every worker, for longer than the timeout).
            Exception: the first error a scheduled function raised since the last join (raised once; the
                functions still queued are cancelled, their RemoteValues raise CancelledError).

        After a successful join the chief's own copies of the parameters hold the ps values.
        """
        while not self._queue.wait(timeout=0.5):
            self._check_health()
        self._check_health()
        self._registry.sync_to_chief()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error once, as ``join``)."""
        self._check_health()
        return self._queue.done()

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Each worker builds its own dataset with ``dataset_fn()`` (or ``dataset_fn(input_context)``).

        As in TF 2.21, ``input_context`` is ``InputContext(num_input_pipelines=1, input_pipeline_id=0)`` on
        every worker; to shard per worker use its ``worker_index`` / ``num_workers`` (an extension, see
        ``per_worker_input.PerWorkerInputContext``). ``dataset_fn`` may also be an iterable, which is sent
        to the workers as it is.
        """
        reg = self._registry
        return PerWorkerDataset(reg, reg.new_dataset(cloudpickle.dumps(dataset_fn_for_workers(dataset_fn))))

    def __reduce__(self):
        raise ValueError("a scheduled function cannot use the ClusterCoordinator (it runs on a worker)")

    def fetch(self, val: object) -> Any:
        """``RemoteValue.fetch()`` applied to every RemoteValue in a (nested) structure."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, (list, tuple)):
            return type(val)(self.fetch(v) for v in val)
        if isinstance(val, dict):
            return {k: self.fetch(v) for k, v in val.items()}
        return val

    # ---- internals -----------------------------------------------------------------------------
    def _worker_lost_at(self, index: int) -> None:
        self._lost_since.setdefault(index, time.monotonic())

    def _check_health(self) -> None:
        s = self.strategy
        if s._fatal is not None:
            self._queue.set_fatal(s._fatal)
        live = self._queue.live
        for i, alive in enumerate(live):
            if alive:
                self._lost_since.pop(i, None)
        if not any(live) and self._queue.pending() and self._lost_since:
            since = min(self._lost_since.values())
            if time.monotonic() - since > s._timeout:
                self._queue.set_fatal(f"no worker has been available for {s._timeout:.0f}s")
        if self._queue.fatal is not None:
            raise UnavailableError(self._queue.fatal)

    # ---- what the strategy tells its coordinator (strategy.CoordinatorHooks) --------------------------
    def _ps_failed(self, message: str) -> None:
        """A ps is gone: ``schedule``/``join``/``done`` raise UnavailableError(message) from now on."""
        self._queue.set_fatal(message)

    def _stop(self, limit: float) -> None:
        """Stops scheduling: queued closures are cancelled, in-flight calls abandoned, and each worker's
        thread joined (at most ``limit`` seconds in all: one still connecting to a task that does not
        answer is left behind)."""
        self._stopped = True
        self._stopping.set()
        self._queue.stop()
        end = time.monotonic() + limit
        for w in self._workers:
            w.thread.join(max(0.0, end - time.monotonic()))

    def _close_clients(self) -> None:
        """Closes every worker's channel (after the strategy shut the tasks down)."""
        for w in self._workers:
            if w.conn is not None:
                w.conn[0].close()

    def traffic(self) -> dict[str, int]:
        """Bytes the workers pulled from and pushed to the ps so far, and closures run."""
        return {
            "pulled_bytes": sum(w.pulled_bytes for w in self._workers),
            "pushed_bytes": sum(w.pushed_bytes for w in self._workers),
            "closures": sum(w.closures_run for w in self._workers),
        }
