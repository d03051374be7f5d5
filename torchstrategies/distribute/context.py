"""The per-thread distribution context: which strategy is current and in which mode.

Three modes, as in TF's ``distribution_strategy_context``:

* default: no scope entered; ``get_strategy()`` is the default strategy and ``get_replica_context()`` its
  single-replica context; ``in_cross_replica_context()`` is False.
* cross-replica: inside ``with strategy.scope():`` (or a ``merge_call`` function): ``get_replica_context()``
  is None, ``in_cross_replica_context()`` is True.
* replica: inside the function given to ``strategy.run``: ``get_replica_context()`` is that replica's
  ``ReplicaContext``.

Each thread has its own stack; the replica threads of MirroredStrategy start with a replica-mode entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.distribute.distribute_lib import ReplicaContext, Strategy, _ScopeContext

__all__ = [
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "get_cross_replica_context",
    "in_cross_replica_context",
    "experimental_set_strategy",
]


@dataclass
class _Mode:
    strategy: Strategy
    replica_context: ReplicaContext | None
    cross_replica: Strategy | None
    is_default: bool = False


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Mode] = []


_state = _ThreadState()
_global_scope_lock = threading.Lock()
_global_scope: _ScopeContext | None = None  # the scope entered by experimental_set_strategy
_global_scope_thread: int | None = None


_cached_default: list[_Mode] = []


def _default_mode() -> _Mode:
    if _cached_default:
        return _cached_default[0]
    from torchstrategies.distribute.distribute_lib import _get_default_strategy

    strategy = _get_default_strategy()
    mode = _Mode(strategy, strategy.extended._default_replica_context(), None, is_default=True)
    _cached_default[:1] = [mode]
    return mode


def current_mode() -> _Mode:
    """The innermost mode of this thread (the default mode when nothing was entered)."""
    if _state.stack:
        return _state.stack[-1]
    return _default_mode()


def push_mode(mode: _Mode) -> None:
    _state.stack.append(mode)


def pop_mode(mode: _Mode) -> None:
    if not _state.stack or _state.stack[-1] is not mode:
        raise RuntimeError(
            "Distribution contexts were exited out of order (a scope or replica context was exited in a "
            "different order than it was entered)"
        )
    _state.stack.pop()


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope (or ``run``) we are in, else the default strategy."""
    return current_mode().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current (TF's ``tf.distribute.has_strategy``)."""
    return not current_mode().is_default


def get_replica_context() -> ReplicaContext | None:
    """The current ReplicaContext, or None in cross-replica context (inside ``scope()`` or merge_call)."""
    return current_mode().replica_context


def get_cross_replica_context() -> Strategy | None:
    """The strategy when in cross-replica context, else None."""
    return current_mode().cross_replica


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (outside ``run``) and inside merge_call functions."""
    return current_mode().cross_replica is not None


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Sets ``strategy`` as the global current strategy (enters its scope until replaced or set to None).

    Raises:
        RuntimeError: called inside a strategy scope.
    """
    global _global_scope, _global_scope_thread
    with _global_scope_lock:
        old, old_thread = _global_scope, _global_scope_thread
        _global_scope, _global_scope_thread = None, None
    if old is not None:
        if old_thread != threading.get_ident():
            raise RuntimeError(
                "experimental_set_strategy must be called from the thread that set the previous strategy"
            )
        old.__exit__(None, None, None)
    if has_strategy():
        raise RuntimeError("Must not be called inside a `tf.distribute.Strategy` scope.")
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        with _global_scope_lock:
            _global_scope, _global_scope_thread = scope, threading.get_ident()
