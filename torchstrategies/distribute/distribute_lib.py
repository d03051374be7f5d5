"""``Strategy`` and the default strategy (TF's distribute_lib, the user's side), and the one import path of
the tf.distribute core's classes: ``ReplicaContext`` / ``ValueContext`` (``distribute/replica_context.py``)
and ``StrategyExtended`` with the hooks a strategy overrides (``distribute/strategy_extended.py``, whose
docstring is the guide to writing a strategy).

Contexts follow TF: ``reduce``/``gather``/``extended.reduce_to`` need cross-replica context (inside
``run`` they raise RuntimeError pointing to ``merge_call``); entering another strategy's scope inside a
scope raises RuntimeError.

Example:
    >>> import torch, torchstrategies as ts
    >>> s = ts.get_strategy()            # the default strategy
    >>> s.run(lambda x: x + 1, args=(torch.tensor(1.0),))
    tensor(2.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute.context import _Mode, has_strategy, pop_mode, push_mode
from torchstrategies.distribute.replica_context import ReplicaContext, ValueContext
from torchstrategies.distribute.strategy_extended import StrategyExtended, require_cross_replica
from torchstrategies.distribute.values import (
    Destinations,
    DistributedValues,
    PerReplica,
    Reducible,
    local_results,
)
from torchstrategies.reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.cluster_resolver import ClusterResolver
    from torchstrategies.collectives.options import CommunicationOptions
    from torchstrategies.distribute.input_lib import (
        DistributedDatasetsFromFunction,
        InputContext,
        InputOptions,
    )

__all__ = ["Strategy", "StrategyExtended", "ReplicaContext", "ValueContext", "require_cross_replica"]

T = TypeVar("T")


class _ScopeContext:
    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self._mode: _Mode | None = None
        self._reentered = False

    def __enter__(self) -> Strategy:
        s = self._strategy
        ext = s.extended
        if ext._is_default:
            if has_strategy():
                raise RuntimeError("Must not nest tf.distribute.Strategy scopes.")
        elif has_strategy():
            require_cross_replica(ext)
            self._reentered = True
            return s
        self._mode = _Mode(s, None, s, is_default=ext._is_default)
        push_mode(self._mode)
        with ext._lock:
            ext._scope_depth += 1
        return s

    def __exit__(self, *exc: object) -> None:
        if self._reentered:
            return
        assert self._mode is not None
        pop_mode(self._mode)
        ext = self._strategy.extended
        with ext._lock:
            ext._scope_depth -= 1
            outermost = ext._scope_depth == 0
        if outermost:
            ext._flush_created()


class Strategy:
    """Base class of all strategies (``tf.distribute.Strategy``); its hooks: ``distribute/strategy_extended.py``.

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.OneDeviceStrategy("cpu")
        >>> with s.scope():
        ...     model = torch.nn.Linear(2, 1)
        >>> s.reduce("sum", s.run(lambda: torch.tensor(3.0)), axis=None)
        tensor(3.)
    """

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        extended._set_container(self)

    # -- properties -------------------------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas over which gradients are aggregated (all processes together)."""
        return self._extended._num_replicas_in_sync

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The cluster resolver of a multi-worker strategy, else None."""
        return getattr(self._extended, "_cluster_resolver", None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} replicas={self.num_replicas_in_sync}>"

    # -- scope and run ----------------------------------------------------------------------------
    def scope(self) -> _ScopeContext:
        """Makes this the current strategy; modules and optimizers created inside are distributed."""
        return _ScopeContext(self)

    def run(
        self,
        fn: Callable[..., object],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
        options: object = None,
    ) -> Any:
        """Runs ``fn`` once per replica in replica context; PerReplica arguments are unwrapped per replica.

        ``options`` (TF's ``RunOptions``) is accepted and ignored.

        Returns:
            The replicas' results, regrouped: PerReplica leaves (a value that is the same object on every
            replica, and every value when there is one local replica, is returned unwrapped).
        """
        if not callable(fn):
            raise TypeError(f"strategy.run expects a callable fn, got {fn!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"strategy.run args must be a tuple or list, got {type(args).__name__}")
        with self.scope():
            self._extended._flush_created()
            return self._extended._call_for_each_replica(fn, tuple(args), dict(kwargs or {}))

    # -- communication ----------------------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: object, axis: int | None = None) -> Any:
        """Reduces ``value`` across replicas (and along ``axis`` within each replica when given).

        MEAN with an axis divides by the true global number of elements along ``axis``, so uneven or
        empty replica batches give the exact global mean.

        Raises:
            RuntimeError: in replica context (use ``get_replica_context().merge_call``/``all_reduce``).
            ValueError: ``reduce_op`` is not SUM/MEAN/MIN/MAX.
        """
        require_cross_replica(self._extended)
        op = ReduceOp.from_any(reduce_op)
        leaves, spec = pytree.tree_flatten(value, is_leaf=lambda x: isinstance(x, DistributedValues))
        out = [self._reduce_one(op, v, axis) for v in leaves]
        return pytree.tree_unflatten(out, spec)

    def _reduce_one(self, op: ReduceOp, value: Reducible, axis: int | None) -> Any:
        ext = self._extended
        if axis is None:
            return ext._reduce(op, value)
        comps = [torch.as_tensor(c) for c in local_results(value)]
        for c in comps:
            rank = c.dim()
            if rank == 0:
                raise ValueError(
                    f"reduce(axis={axis}): the value has rank 0 (a scalar), no axis to reduce along; use "
                    "axis=None"
                )
            if not -rank <= axis < rank:
                raise ValueError(
                    f"reduce(axis={axis}): the axis is out of range for a value of rank {rank} (shape "
                    f"{tuple(c.shape)}); give an axis in [{-rank}, {rank - 1}] or axis=None"
                )

        def rewrap(xs: list[torch.Tensor]) -> PerReplica[torch.Tensor] | torch.Tensor:
            return PerReplica(xs) if isinstance(value, DistributedValues) else xs[0]

        if op == ReduceOp.SUM:
            return ext._reduce(op, rewrap([c.sum(dim=axis) for c in comps]))
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            fn = torch.amin if op == ReduceOp.MIN else torch.amax
            return ext._reduce(op, rewrap([fn(c, dim=axis) for c in comps]))
        numer = ext._reduce(ReduceOp.SUM, rewrap([c.sum(dim=axis) for c in comps]))
        counts = [torch.tensor(c.shape[axis], dtype=numer.dtype, device=c.device) for c in comps]
        denom = ext._reduce(ReduceOp.SUM, rewrap(counts))
        return numer / denom.to(numer.device)

    def gather(self, value: Reducible, axis: int) -> Any:
        """Concatenates the replicas' components of ``value`` along ``axis`` (cross-replica context)."""
        require_cross_replica(self._extended)
        return self._extended._gather_to(value, None, axis, None)

    @overload
    def experimental_local_results(self, value: DistributedValues[T]) -> tuple[T, ...]: ...
    @overload
    def experimental_local_results(self, value: object) -> tuple[Any, ...]: ...
    def experimental_local_results(self, value: object) -> tuple[Any, ...]:
        """The components of ``value`` for this process's replicas, as a tuple."""
        return self._extended._local_results(value)

    # -- input ------------------------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Iterable[object], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """Splits each global batch of ``dataset`` along dim 0 across the replicas (TF's rules).

        A ``DistributedDataset`` here; a strategy may return its own iterable (MultiWorkerMirrored gives a
        map-style DataLoader a ``WorkerShardedDataset``)."""
        return self._extended._experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[object]], options: InputOptions | None = None
    ) -> DistributedDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext)`` per input pipeline; each yields per-replica batches."""
        return self._extended._distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], object]) -> Any:
        """A PerReplica of ``value_fn(ValueContext)`` for each local replica."""
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {value_fn!r}")
        return self._extended._experimental_distribute_values_from_function(value_fn)


class _DefaultExtended(StrategyExtended):
    _is_default = True

    def _reduce_to(
        self, op: ReduceOp, value: Reducible, destinations: Destinations | None, options: CommunicationOptions | None
    ) -> Any:
        comps = local_results(value)
        return self._to_destinations(torch.as_tensor(comps[0]), self._destination_devices(destinations))

    def _reduce(self, op: ReduceOp, value: Reducible) -> Any:
        # The default strategy returns the value unchanged (on its device).
        return local_results(value)[0]


class _DefaultDistributionStrategy(Strategy):
    """The strategy in effect outside any scope: one replica, no distribution."""

    def __init__(self) -> None:
        super().__init__(_DefaultExtended())

    def __repr__(self) -> str:
        return "<DefaultDistributionStrategy>"


_default_strategy: _DefaultDistributionStrategy | None = None
_default_lock = threading.Lock()


def _get_default_strategy() -> _DefaultDistributionStrategy:
    global _default_strategy
    if _default_strategy is None:
        with _default_lock:
            if _default_strategy is None:
                _default_strategy = _DefaultDistributionStrategy()
    return _default_strategy
