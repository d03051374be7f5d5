"""``RemoteValue``: the result of a scheduled function, available later (``tf.distribute.coordinator.RemoteValue``)."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any

import torch

from torchstrategies.errors import CancelledError, DeadlineExceededError

__all__ = ["PerWorkerValues", "RemoteValue", "RemoteValueStatus", "map_tensors"]


class RemoteValueStatus(enum.Enum):
    """NOT_READY (not run yet), ABORTED (its worker failed; it will run again), READY (value or error)."""

    NOT_READY = "NOT_READY"
    ABORTED = "ABORTED"
    READY = "READY"


class RemoteValue:
    """The asynchronously available value of ``ClusterCoordinator.schedule(fn)``.

    ``fetch()`` waits for the value and returns it with tensors converted to numpy arrays (TF's ``fetch``);
    ``get()`` waits and returns it as produced (tensors stay tensors). Both raise the closure's exception if it
    raised, and :class:`~torchstrategies.errors.CancelledError` if it was cancelled because an earlier closure
    failed.

    Example:
        >>> rv = coordinator.schedule(lambda: torch.tensor(2.0))   # doctest: +SKIP
        >>> rv.fetch()                                              # doctest: +SKIP
        array(2., dtype=float32)
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._status = RemoteValueStatus.NOT_READY
        self._value: object = None
        self._error: BaseException | None = None
        self._fetched: object = None
        self._has_fetched = False

    # ---- set by the coordinator ----------------------------------------------------------------
    def _set_value(self, value: object) -> None:
        with self._cond:
            self._value, self._error = value, None
            self._status = RemoteValueStatus.READY
            self._cond.notify_all()

    def _set_error(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._status = RemoteValueStatus.READY
            self._cond.notify_all()

    def _set_aborted(self) -> None:
        with self._cond:
            if self._status is RemoteValueStatus.NOT_READY:
                self._status = RemoteValueStatus.ABORTED

    def _mark_cancelled(self) -> None:
        self._set_error(CancelledError("The corresponding function is cancelled. Please reschedule the function."))

    # ---- public --------------------------------------------------------------------------------
    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def _wait(self, timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._status is RemoteValueStatus.READY, timeout=timeout):
                raise DeadlineExceededError(f"the scheduled function did not finish within {timeout}s")
        if self._error is not None:
            raise self._error

    def get(self, timeout: float | None = None) -> Any:
        """Waits for the function's result and returns it (tensors as tensors)."""
        self._wait(timeout)
        return self._value

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the function's result and returns it with tensors as numpy arrays."""
        self._wait(timeout)
        if not self._has_fetched:
            self._fetched = map_tensors(_to_numpy, self._value)
            self._has_fetched = True
        return self._fetched

    def __repr__(self) -> str:
        return f"RemoteValue(status={self._status.value})"


class PerWorkerValues:
    """One value per worker; used as an argument of ``schedule``, each worker receives its own element.

    Example:
        >>> vals = PerWorkerValues([10, 20])     # worker 0 gets 10, worker 1 gets 20
    """

    def __init__(self, values):
        self._values = tuple(values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._values!r})"


def map_tensors(fn: Callable[[torch.Tensor], object], obj: object) -> object:
    """``obj`` with ``fn`` applied to every tensor in it (through lists, tuples, namedtuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_make"):     # a namedtuple
        return obj._make(map_tensors(fn, x) for x in obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _to_numpy(t: torch.Tensor) -> object:
    return t.detach().cpu().numpy()
