"""One way to read an enum member from what a user passes: the member itself or its name in any case.

``ReduceOp``, ``CommunicationImplementation``, ``VariableAggregation``, ``VariableSynchronization`` and
``AggregationMethod`` parse their arguments with :func:`member`; each keeps its own error message (and
its own extra spellings, such as None for a default).
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["member"]

E = TypeVar("E", bound=enum.Enum)


def member(cls: type[E], value: object) -> E | None:
    """``value`` if it is a member of ``cls``, the member named ``value`` (any case) if it is a string, else
    None (the caller raises its own ValueError naming the value)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    return None
