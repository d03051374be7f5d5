"""Errors raised by distributed operations, named as in ``tf.errors``."""

from __future__ import annotations

__all__ = [
    "UnavailableError", "DeadlineExceededError", "CancelledError", "TorchStrategiesError", "ReplicaDivergenceError",
    "MembershipBelowMinimumError",
]


class TorchStrategiesError(RuntimeError):
    """Base class of torchstrategies' distributed errors."""


class UnavailableError(TorchStrategiesError):
    """A peer (worker, parameter server, rank) is gone or cannot be reached."""


class DeadlineExceededError(TorchStrategiesError, TimeoutError):
    """An operation did not complete within its timeout."""


class CancelledError(TorchStrategiesError):
    """An operation was cancelled (e.g. a closure cancelled after an earlier error)."""


class ReplicaDivergenceError(TorchStrategiesError):
    """Replicas (in-process replicas or MultiWorkerMirrored ranks) hold different values of a tensor that
    must be the same on every replica (a parameter, an integer buffer); the message names the tensor."""


class MembershipBelowMinimumError(UnavailableError):
    """A fault-tolerant MultiWorkerMirrored job has fewer live workers than ``FaultTolerance.min_workers``:
    the message names the generation, its members and the minimum."""
