"""``ReplicaContext`` (one replica inside ``strategy.run``: merge_call, all_reduce, all_gather) and
``ValueContext`` (what ``experimental_distribute_values_from_function``'s ``value_fn`` gets): TF's
distribute_lib, the replica's side. Re-exported by ``distribute/distribute_lib.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute import context
from torchstrategies.distribute.context import _Mode, pop_mode, push_mode
from torchstrategies.distribute.values import PerReplica
from torchstrategies.reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.collectives.options import CommunicationOptions
    from torchstrategies.distribute.distribute_lib import Strategy

__all__ = ["ReplicaContext", "ValueContext"]

T = TypeVar("T")


class ValueContext:
    """What the ``value_fn`` of ``experimental_distribute_values_from_function`` gets (ValueContext)."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> def step():
        ...     ctx = ts.get_replica_context()
        ...     return ctx.all_reduce("sum", torch.tensor(float(ctx.replica_id_in_sync_group)))
        >>> s.experimental_local_results(s.run(step))
        (tensor(1.), tensor(1.))
    """

    def __init__(
        self, strategy: Strategy, replica_id_in_sync_group: int = 0, local_replica_id: int | None = None
    ):
        self._strategy = strategy
        self._replica_id_in_sync_group = int(replica_id_in_sync_group)
        self._local_replica_id = (
            int(local_replica_id)
            if local_replica_id is not None
            else self._replica_id_in_sync_group - strategy.extended._replica_id_offset
        )
        self._mode: _Mode | None = None

    def __enter__(self) -> ReplicaContext:
        self._mode = _Mode(self._strategy, self, None, is_default=self._strategy.extended._is_default)
        push_mode(self._mode)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        pop_mode(self._mode)
        self._mode = None

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas in sync (an int, 0-based)."""
        return self._replica_id_in_sync_group

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return (self._strategy.extended.worker_devices[self._local_replica_id],)

    def _require_current(self, what: str) -> None:
        if context.get_replica_context() is not self:
            raise RuntimeError(
                f"{what} must be called in this replica's context (inside strategy.run, by the replica that "
                "owns the ReplicaContext)"
            )

    def merge_call(
        self,
        merge_fn: Callable[..., object],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        """Calls ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context, for all replicas.

        Every replica must call merge_call the same number of times. Arguments from the replicas arrive as
        PerReplica values (unwrapped when there is one local replica or all replicas passed the same
        object); each replica receives its own component of the result.

        Raises:
            RuntimeError: not in this replica's context, or the replicas made different numbers of
                merge_calls.
        """
        self._require_current("merge_call")
        if not callable(merge_fn):
            raise TypeError(f"merge_call expects a callable merge_fn, got {merge_fn!r}")
        return self._strategy.extended._merge_call(self, merge_fn, tuple(args), dict(kwargs or {}))

    def all_reduce(
        self, reduce_op: ReduceOp | str, value: T, options: CommunicationOptions | None = None
    ) -> T:
        """All-reduces ``value`` (a tensor or a structure of tensors) across replicas; not differentiable."""
        op = ReduceOp.from_any(reduce_op)
        leaves, spec = pytree.tree_flatten(value)
        if not leaves:
            return value

        def merge_fn(
            strategy: Strategy, ops: ReduceOp | PerReplica[ReduceOp], *vals: PerReplica[object] | torch.Tensor
        ) -> tuple[object, ...]:
            per_replica = ops.values if isinstance(ops, PerReplica) else (ops,)
            if any(o is not per_replica[0] for o in per_replica):
                names = ", ".join(f"replica {i}: {o.name}" for i, o in enumerate(per_replica))
                raise ValueError(
                    f"ReplicaContext.all_reduce was called with different reduce ops on different replicas "
                    f"({names}); every replica must pass the same op"
                )
            pairs = [(v, v) for v in vals]
            return tuple(strategy.extended.batch_reduce_to(op, pairs, options))

        reduced = self.merge_call(merge_fn, args=(op, *leaves))
        return pytree.tree_unflatten(list(reduced), spec)

    def all_gather(self, value: T, axis: int, options: CommunicationOptions | None = None) -> T:
        """Concatenates each replica's ``value`` along ``axis``; every replica gets the whole result."""
        leaves, spec = pytree.tree_flatten(value)

        def merge_fn(strategy: Strategy, *vals: PerReplica[object] | torch.Tensor) -> tuple[object, ...]:
            return tuple(strategy.extended._gather_to(v, v, axis, options) for v in vals)

        gathered = self.merge_call(merge_fn, args=tuple(leaves))
        return pytree.tree_unflatten(list(gathered), spec)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"strategy={self._strategy})"
        )
