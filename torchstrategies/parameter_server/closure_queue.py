"""The coordinator's closure queue with TF's error contract (``_CoordinatedClosureQueue``).

* ``put`` enqueues; if an earlier closure failed, the error is raised (once) and queued closures are cancelled.
* ``wait`` (``join``) blocks until every closure finished, or raises the first closure error (once, then it is
  cleared) after cancelling the queued ones and letting the in-flight ones end.
* ``done`` returns whether nothing is queued or in flight, raising the pending error (once) first.
* ``put_back`` re-queues the closure of a worker that died (a closure may run more than once).
* A fatal error (a ps is gone) is sticky: every ``put``/``wait``/``done`` raises it from then on.
* ``max_staleness=k`` (stale-synchronous parallel): a worker takes no new closure while it has completed more
  than ``k`` closures more than the slowest live worker.
"""

from __future__ import annotations

import collections
import threading
import time

from torchstrategies.errors import UnavailableError

__all__ = ["ClosureQueue"]

_POLL = 0.2


class ClosureQueue:
    def __init__(self, num_workers: int, max_staleness: int | None = None):
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: str | None = None
        self._stopped = False
        self.max_staleness = max_staleness
        self.completed = [0] * num_workers
        self.live = [True] * num_workers
        self.requeued = 0  # closures put back after their worker died or froze (each may run twice)

    # ---- errors --------------------------------------------------------------------------------
    def set_fatal(self, message: str) -> None:
        with self._cond:
            if self._fatal is None:
                self._fatal = message
                self._cancel_queued()
            self._cond.notify_all()

    @property
    def fatal(self) -> str | None:
        return self._fatal

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise UnavailableError(self._fatal)

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft().mark_cancelled()

    def _raise_if_error(self) -> None:
        """Expects the lock held. Cancels queued closures, waits for in-flight ones, raises and clears."""
        self._raise_fatal()
        if self._error is None:
            return
        self._cancel_queued()
        while self._inflight > 0 and self._fatal is None:
            self._cond.wait(_POLL)
        self._raise_fatal()
        err, self._error = self._error, None
        raise err

    # ---- the coordinator's side ----------------------------------------------------------------
    def put(self, closure) -> None:
        with self._cond:
            self._raise_fatal()
            self._queue.append(closure)
            self._raise_if_error()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._error is None and self._fatal is None and (self._queue or self._inflight > 0):
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._cond.wait(_POLL)
            self._raise_if_error()
            return True

    def done(self) -> bool:
        with self._cond:
            self._raise_if_error()
            return not self._queue and self._inflight == 0

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cancel_queued()
            self._cond.notify_all()

    # ---- the worker threads' side --------------------------------------------------------------
    def _may_start(self, worker: int) -> bool:
        if self.max_staleness is None:
            return True
        live = [c for c, alive in zip(self.completed, self.live) if alive]
        return not live or self.completed[worker] - min(live) <= self.max_staleness

    def get(self, worker: int, timeout: float = _POLL):
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._stopped or (self._queue and self._may_start(worker)), timeout)
            if not ready or self._stopped:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def mark_finished(self, worker: int) -> None:
        with self._cond:
            self._inflight -= 1
            self.completed[worker] += 1
            self._cond.notify_all()

    def mark_failed(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._inflight -= 1
            self._cond.notify_all()

    def put_back(self, closure) -> None:
        with self._cond:
            self._inflight -= 1
            if self._error is not None or self._fatal is not None or self._stopped:
                closure.mark_cancelled()
            else:
                closure.remote_value._set_aborted()
                self._queue.appendleft(closure)
                self.requeued += 1
            self._cond.notify_all()

    def set_live(self, worker: int, alive: bool) -> None:
        with self._cond:
            self.live[worker] = alive
            self._cond.notify_all()

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queue) or self._inflight > 0
