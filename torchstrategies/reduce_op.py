"""``ReduceOp``: how values from several replicas are combined (``tf.distribute.ReduceOp``).

Example:
    >>> import torchstrategies as ts
    >>> ts.ReduceOp.from_any("mean")
    <ReduceOp.MEAN: 'MEAN'>
"""

from __future__ import annotations

import enum

from torchstrategies._enum_names import parse

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """SUM and MEAN as in TF; MIN and MAX are an extension (used by the collectives)."""

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @classmethod
    def from_any(cls, op: ReduceOp | str) -> ReduceOp:
        """Accepts the enum or its name in any case ("sum", "MEAN"); raises ValueError otherwise."""
        return parse(cls, op, "Invalid reduce op {value}: expected one of {names} (or their names)")
