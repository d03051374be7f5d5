"""Variable enums of ``tf.VariableSynchronization`` / ``tf.VariableAggregation``.

Example:
    >>> import torchstrategies as ts
    >>> ts.VariableAggregation.MEAN
    <VariableAggregation.MEAN: 2>
"""

from __future__ import annotations

import enum

from torchstrategies._enum_names import member
from torchstrategies.reduce_op import ReduceOp

__all__ = ["VariableSynchronization", "VariableAggregation", "reduce_op_for"]


class VariableSynchronization(enum.Enum):
    """When a distributed variable's replicas are synchronized (as ``tf.VariableSynchronization``).

    AUTO: the strategy chooses (ON_WRITE for mirrored strategies). NONE: one copy, no synchronization
    (an error under a strategy, as in TF). ON_WRITE: every write is applied to all replicas (mirrored).
    ON_READ: each replica writes its own copy; a cross-replica read aggregates them.
    """

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3

    @classmethod
    def from_any(cls, value: VariableSynchronization | str | None) -> VariableSynchronization:
        """Accepts the enum, its name in any case, or None (= AUTO)."""
        found = cls.AUTO if value is None else member(cls, value)
        if found is not None:
            return found
        raise ValueError(
            f"Invalid variable synchronization mode: {value!r}. Expected one of AUTO, NONE, ON_WRITE, ON_READ"
        )


class VariableAggregation(enum.Enum):
    """How per-replica updates (ON_WRITE) or copies (ON_READ) are combined (``tf.VariableAggregation``)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3

    @classmethod
    def from_any(cls, value: VariableAggregation | str | None) -> VariableAggregation:
        """Accepts the enum, its name in any case, or None (= NONE)."""
        found = cls.NONE if value is None else member(cls, value.name if isinstance(value, ReduceOp) else value)
        if found is not None:
            return found
        raise ValueError(
            f"Invalid variable aggregation mode: {value!r} for variable. Expected one of NONE, SUM, MEAN, "
            "ONLY_FIRST_REPLICA"
        )


def reduce_op_for(aggregation: VariableAggregation) -> ReduceOp:
    """The ReduceOp matching a SUM/MEAN aggregation (ONLY_FIRST_REPLICA maps to MEAN, as TF does)."""
    if aggregation == VariableAggregation.SUM:
        return ReduceOp.SUM
    if aggregation in (VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA):
        return ReduceOp.MEAN
    raise ValueError(f"No reduce op for aggregation {aggregation!r}")
