"""One way to read an enum member from what a user passes: the member itself or its name in any case.

``ReduceOp``, ``CommunicationImplementation``, ``VariableAggregation``, ``VariableSynchronization`` and
``AggregationMethod`` parse their arguments here; each keeps its own error message (and its own extra
spellings: None for a default, a ReduceOp for an aggregation, an int for an AggregationMethod).
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["member", "parse"]

E = TypeVar("E", bound=enum.Enum)


def member(cls: type[E], value: object) -> E | None:
    """``value`` if it is a member of ``cls``, the member named ``value`` (any case) if it is a string, else
    None."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    return None


def parse(cls: type[E], value: object, message: str, default: E | None = None) -> E:
    """Like :func:`member`, with None read as ``default`` (when given); anything else raises ValueError with
    ``message``, in which ``{value}`` stands for ``repr(value)`` and ``{names}`` for the members' names."""
    found = default if value is None else member(cls, value)
    if found is None:
        raise ValueError(message.format(value=repr(value), names=", ".join(cls.__members__)))
    return found
