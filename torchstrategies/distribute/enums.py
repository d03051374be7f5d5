"""Variable enums of ``tf.VariableSynchronization`` / ``tf.VariableAggregation``.

Example:
    >>> import torchstrategies as ts
    >>> ts.VariableAggregation.MEAN
    <VariableAggregation.MEAN: 2>
"""

from __future__ import annotations

import enum

from torchstrategies._enum_names import parse
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
        return parse(cls, value, "Invalid variable synchronization mode: {value}. Expected one of {names}", cls.AUTO)


class VariableAggregation(enum.Enum):
    """How per-replica updates (ON_WRITE) or copies (ON_READ) are combined (``tf.VariableAggregation``)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3

    @classmethod
    def from_any(cls, value: VariableAggregation | str | None) -> VariableAggregation:
        """Accepts the enum, its name in any case, or None (= NONE)."""
        if isinstance(value, ReduceOp) and value.name in cls.__members__:
            return cls[value.name]
        return parse(cls, value, "Invalid variable aggregation mode: {value} for variable. Expected one of {names}",
                     cls.NONE)


def reduce_op_for(aggregation: VariableAggregation) -> ReduceOp:
    """The ReduceOp matching a SUM/MEAN aggregation (ONLY_FIRST_REPLICA maps to MEAN, as TF does)."""
    if aggregation == VariableAggregation.SUM:
        return ReduceOp.SUM
    if aggregation in (VariableAggregation.MEAN, VariableAggregation.ONLY_FIRST_REPLICA):
        return ReduceOp.MEAN
    raise ValueError(f"No reduce op for aggregation {aggregation!r}")
