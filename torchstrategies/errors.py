"""Errors raised by distributed operations, named as in ``tf.errors``."""

from __future__ import annotations

__all__ = [
    "UnavailableError", "DeadlineExceededError", "CancelledError", "TorchStrategiesError", "ReplicaDivergenceError",
    "MembershipBelowMinimumError", "CollectiveAfterCommitError", "CheckpointError",
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
    must be the same on every replica (a parameter, a buffer not declared MEAN).

    Raised by the agreement seam (``distribute/agreement.py``, docs/strategies.md "Agreement"); the message
    names the tensor, the ranks or replicas that differ, when, and the likely cause, which are also kept as
    attributes.

    Attributes:
        tensor: the tensor's name ("Linear.weight"), or None.
        replicas: the ranks (or in-process replicas) whose value differs from rank (replica) 0's.
        when: when it was found ("optimizer step 3", "the checkpoint save to ...").
        cause: the likely cause and what to do.
    """

    def __init__(self, message: str, tensor: str | None = None, replicas: list[int] | None = None,
                 when: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.tensor, self.replicas, self.when, self.cause = tensor, list(replicas or []), when, cause


class MembershipBelowMinimumError(UnavailableError):
    """A fault-tolerant MultiWorkerMirrored job has fewer live workers than ``FaultTolerance.min_workers``:
    the message names the generation, its members and the minimum."""


class CollectiveAfterCommitError(TorchStrategiesError):
    """A fault-tolerant MultiWorkerMirrored step asked for a collective (``strategy.reduce``, a gather) after
    its commit point, the end of ``loss.backward()``: the step is then applied on every member, and a collective
    that a lost member makes fail could no longer be undone (some members would hold its result, others not).
    Raised on every member, before anything is sent; the message names the step and where to move the call."""


class CheckpointError(ValueError):
    """A checkpoint file cannot be restored into the given objects: it is damaged (empty, truncated, changed
    after it was written) or holds other shapes, dtypes or entries; the message names the file and what is
    wrong. Nothing was changed by the failed restore."""
