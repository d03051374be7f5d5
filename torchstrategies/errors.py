"""Errors raised by distributed operations, named as in ``tf.errors``."""

from __future__ import annotations

__all__ = [
    "UnavailableError", "DeadlineExceededError", "CancelledError", "TorchStrategiesError", "ReplicaDivergenceError",
    "CheckpointError",
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


class CheckpointError(ValueError):
    """A checkpoint file cannot be restored into the given objects: it is damaged (empty, truncated, changed
    after it was written) or holds other shapes, dtypes or entries; the message names the file and what is
    wrong. Nothing was changed by the failed restore."""
