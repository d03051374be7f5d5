"""``Strategy``, ``StrategyExtended``, ``ReplicaContext`` and the default strategy (TF's distribute_lib).

How a strategy plugs in
=======================

A strategy is a ``Strategy`` subclass holding a ``StrategyExtended`` subclass::

    class MyStrategy(Strategy):
        def __init__(self, ...):
            super().__init__(MyExtended(...))   # Strategy.__init__ attaches the extended to it

    class MyExtended(StrategyExtended):
        ...override the hooks below...

Public methods (``Strategy.run/reduce/gather/...``, ``StrategyExtended.reduce_to/batch_reduce_to/update``)
check the context and arguments, then call these hooks. Override what differs; the defaults describe a
strategy with ONE local replica (this process) whose ``replica_id_in_sync_group`` is
``_replica_id_offset`` (e.g. the rank for MultiWorkerMirrored) out of ``_num_replicas_in_sync``:

Replicas
    ``_num_replicas_in_sync`` (int, default 1), ``_replica_id_offset`` (int, default 0),
    ``worker_devices`` (tuple of ``torch.device``, one per LOCAL replica, default ``(cpu,)``),
    ``parameter_devices`` (default ``worker_devices``), ``_reduce_device`` (where ``strategy.reduce`` /
    ``gather`` results go, default ``worker_devices[0]``).
Running
    ``_call_for_each_replica(fn, args, kwargs)``: run ``fn`` once per local replica in replica context and
    return ``regroup``-ed results. Default: one call in this thread inside ``ReplicaContext(strategy,
    _replica_id_offset)`` with PerReplica arguments unwrapped to component 0.
    ``_merge_call(replica_context, merge_fn, args, kwargs)``: default calls ``merge_fn(strategy, *args,
    **kwargs)`` in cross-replica context (correct for one local replica).
Communication (cross-replica context; ``value`` is a DistributedValues or a plain tensor)
    ``_reduce_to(op, value, destinations, options)`` -> tensor (one destination device) or Mirrored.
    ``op`` is a ``ReduceOp`` (already validated); ``destinations`` None means ``_reduce_device``. The
    default only moves a one-component value (a plain value with SUM and several replicas is TF's
    ValueError): a strategy whose replicas span processes MUST override it with its collective.
    ``_batch_reduce_to(op, pairs, options)`` (default loops ``_reduce_to``; override to pack);
    ``_gather_to(value, destinations, axis, options)`` (default: concatenate local components; a
    multi-process strategy overrides it with an all-gather along ``axis``, sizes may differ per replica);
    ``_update(var, fn, args, kwargs, group)`` (default: ``fn(c, *args)`` under ``torch.no_grad`` for each
    ``c`` in ``_update_components(var)``); ``_local_results(value)``.
    ``ReplicaContext.all_reduce/all_gather`` go through ``merge_call`` -> ``batch_reduce_to`` /
    ``_gather_to``, and ``compute_average_loss`` all-reduces the batch size, so these hooks serve both.
Creation (called by the tracker in ``distribute/creation.py`` while ``scope()`` is current)
    ``_create_parameter(module, name, param)`` -> replacement ``nn.Parameter`` or None (keep). Called at
    registration, BEFORE the module initializes the value: do not read or broadcast it here.
    ``_create_buffer(module, name, buffer)`` -> replacement tensor or None.
    ``_on_module_created(module)``: a fully constructed top-level module made in the scope (called at
    the outermost scope exit or the next ``run``); broadcast / place / hook gradients here. It can be
    called again for a parent that later adopts the module: be idempotent per parameter.
    ``_on_optimizer_created(optimizer)``: right after ``torch.optim.Optimizer.__init__``; e.g. replace
    ``optimizer.step`` by an instance attribute.
    ``_on_keras_module(module)``: a top-level Keras 3 layer or model, just before ``_on_module_created``
    (default: refused with several replicas; Mirrored and MultiWorkerMirrored attach ``strategies/_keras.py``).
    ``_create_variable(initial_value, synchronization, aggregation, trainable, name)`` for ``ts.Variable``.
Input
    ``_experimental_distribute_dataset(dataset, options)``, ``_distribute_datasets_from_function(fn,
    options)``, ``_experimental_distribute_values_from_function(value_fn)``; defaults use
    ``distribute/input_lib.py`` with ``num_input_pipelines``/``input_pipeline_id`` from
    ``_input_workers()`` (default 1 pipeline, id 0).

Recipe: one replica per process (MultiWorkerMirroredStrategy)
    Subclass ``StrategyExtended`` (not MirroredExtended). In ``__init__`` set ``_num_replicas_in_sync =
    world_size``, ``_replica_id_offset = rank``, ``_worker_devices = (this rank's device,)``; keep the
    default ``_call_for_each_replica``/``_merge_call``. Override ``_reduce_to``/``_batch_reduce_to``/
    ``_gather_to`` with the collectives, ``_input_workers`` -> ``(world_size, rank)`` (the distributed
    dataset then keeps this rank's slice of every global batch, split evenly over all replicas),
    ``_on_module_created`` to broadcast rank 0's parameters and buffers and register gradient hooks (or
    ``_on_optimizer_created`` to all-reduce ``p.grad`` (SUM) before the step, e.g. with
    ``optimizer.register_step_pre_hook``), and ``_create_variable`` for ts.Variables (default: a local one).
    Modules are tracked per scope; every rank must create the same modules in the same order, since the
    hooks run collectives. ``tests/test_distribute_plugin.py`` is a 60-line working example on gloo.
Recipe: variables elsewhere (ParameterServerStrategy)
    Override ``_create_parameter`` to return a parameter placed/recorded for its parameter server (the
    value is not initialized yet), ``_on_module_created`` to push the initialized values, and
    ``_on_optimizer_created`` to route the update to the servers; ``_call_for_each_replica`` is called by
    the coordinator's closures.
In-process replicas (Mirrored, CentralStorage)
    ``strategies/mirrored.py``'s ``MirroredExtended`` runs replicas one at a time (``distribute/mirrored_run``)
    and replicates parameters/buffers (``distribute/replicated.py``); subclass it for such strategies.

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

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute import context, creation, device_util
from torchstrategies.distribute.context import _Mode, current_mode, has_strategy, pop_mode, push_mode
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization
from torchstrategies.distribute.torch_patches import Lease
from torchstrategies.distribute.values import (
    Destinations,
    DistributedValues,
    Mirrored,
    PerReplica,
    Reducible,
    checked_pairs,
    local_results,
    regroup,
    select_replica,
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
    from torchstrategies.distribute.variables import Variable

__all__ = ["Strategy", "StrategyExtended", "ReplicaContext", "ValueContext", "require_cross_replica"]

_NESTED = (DistributedValues, list, tuple, dict)  # run arguments that may hold per-replica values
T = TypeVar("T")


def _wrong_strategy_scope(strategy: Strategy, mode: _Mode) -> None:
    if not has_strategy():
        raise RuntimeError(f'Need to be inside "with strategy.scope()" for {strategy}')
    raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {mode.strategy} is not {strategy}")


def require_cross_replica(extended: StrategyExtended, error_message: str | None = None) -> None:
    """Raises unless in cross-replica context of ``extended``'s strategy or in the default context."""
    mode = current_mode()
    if mode.cross_replica is not None and mode.cross_replica.extended is extended:
        return
    if mode.is_default and mode.cross_replica is None:
        return
    strategy = extended._container_strategy()
    if mode.strategy is not strategy:
        _wrong_strategy_scope(strategy, mode)
    raise RuntimeError(
        error_message
        or "Method requires being in cross-replica context, use get_replica_context().merge_call()"
    )


def _to_device(x: DeviceLike | torch.Tensor) -> torch.device:
    if isinstance(x, torch.Tensor):
        return x.device
    return device_util.resolve(x)


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
    """Base class of all strategies (``tf.distribute.Strategy``). See the module docstring for the hooks.

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


def _is_keras(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Keras 3 layer or model (torch backend), recognized by its classes' module so
    that Keras is never imported here."""
    return any(c.__module__.split(".")[0] == "keras" for c in type(module).__mro__)


class StrategyExtended:
    """Extended API and subclass hooks of a strategy (``tf.distribute.StrategyExtended``)."""

    _is_default = False
    # The context modes of an in-process run's replicas, made once per strategy (``mirrored_run._modes``).
    _replica_modes: list[_Mode]

    def __init__(self, container_strategy: Strategy | None = None):
        self._container_ref: weakref.ref[Strategy] | None = None
        self._lock = threading.RLock()
        self._scope_depth = 0
        self._tracked_modules: list[weakref.ref[torch.nn.Module]] = []
        self._tracked_ids: set[int] = set()
        self._created_vars: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._num_replicas_in_sync = 1
        self._replica_id_offset = 0
        self._worker_devices: tuple[torch.device, ...] = (torch.device("cpu"),)
        self._parameter_devices: tuple[torch.device, ...] | None = None
        if container_strategy is not None:
            self._set_container(container_strategy)
        # torch's globals this strategy needs, held while it lives (distribute/torch_patches.py).
        self._torch_leases: list[Lease] = [] if self._is_default else [creation.PATCHES.acquire(self)]

    def _release_torch_patches(self) -> None:
        """Gives back this strategy's claim on torch's globals (``shutdown()``; also done when collected)."""
        for lease in self._torch_leases:
            lease.release()

    def _set_container(self, strategy: Strategy) -> None:
        self._container_ref = weakref.ref(strategy)

    def _container_strategy(self) -> Strategy:
        s = self._container_ref() if self._container_ref is not None else None
        if s is None:
            raise RuntimeError("This StrategyExtended is not attached to a live Strategy")
        return s

    # -- description ------------------------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[torch.device, ...]:
        """One device per local replica."""
        return self._worker_devices

    @property
    def parameter_devices(self) -> tuple[torch.device, ...]:
        """Devices holding the variables."""
        return self._parameter_devices if self._parameter_devices is not None else self._worker_devices

    @property
    def _num_local_replicas(self) -> int:
        return len(self._worker_devices)

    @property
    def _reduce_device(self) -> torch.device:
        return self._worker_devices[0]

    def _default_replica_context(self) -> ReplicaContext:
        return ReplicaContext(self._container_strategy(), self._replica_id_offset, 0)

    # -- public extended API ----------------------------------------------------------------------
    def reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value: Reducible,
        destinations: Destinations | None,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduces ``value`` to ``destinations`` (a device, a tensor, or a DistributedValues' devices).

        Returns:
            A tensor when the destination is one device, else a Mirrored.
        """
        require_cross_replica(self)
        op = ReduceOp.from_any(reduce_op)
        return self._reduce_to(op, value, destinations, options)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Reducible, Destinations]],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """``reduce_to`` for many (value, destinations) pairs at once (packed where the strategy can)."""
        require_cross_replica(self)
        op = ReduceOp.from_any(reduce_op)
        return self._batch_reduce_to(op, checked_pairs("batch_reduce_to", value_destination_pairs), options)

    def update(
        self,
        var: Variable | torch.Tensor | DistributedValues[object],
        fn: Callable[..., object],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
        group: bool = True,
    ) -> Any:
        """Runs ``fn(var_component, *args, **kwargs)`` on each copy of ``var`` (cross-replica context)."""
        require_cross_replica(self)
        return self._update(var, fn, tuple(args), dict(kwargs or {}), group)

    def variable_created_in_scope(self, v: object) -> bool:
        """Whether ``v`` (a parameter, buffer or ts.Variable) was created inside this strategy's scope."""
        return self._created_vars.get(id(v)) is v

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: object) -> Iterator[None]:
        """A context in which new variables are placed with ``colocate_with_variable`` (TF's
        ``colocate_vars_with``), which must have been created in this strategy's scope.

        The in-process and multi-worker strategies place every variable on the same devices, so
        variables made in the context are colocated with it already; ParameterServerStrategy still
        places them round-robin over the ps tasks.

        Raises:
            RuntimeError: not in this strategy's scope.
            ValueError: ``colocate_with_variable`` was not created in this strategy's scope.

        Example:
            >>> import torchstrategies as ts
            >>> s = ts.OneDeviceStrategy("cpu")
            >>> with s.scope():
            ...     v = ts.Variable(1.0)
            ...     with s.extended.colocate_vars_with(v):
            ...         w = ts.Variable(2.0)
        """
        mode = current_mode()
        if mode.strategy is not self._container_strategy():
            _wrong_strategy_scope(self._container_strategy(), mode)
        if not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(
                "`colocate_vars_with` must only be passed a variable created in this "
                f"tf.distribute.Strategy.scope(), not: {colocate_with_variable!r}"
            )
        yield

    def value_container(self, value: object) -> object:
        """The variable ``value`` is a component of (e.g. what ``update`` handed ``fn``), else ``value``.

        TF's rule holds: ``value`` is in ``experimental_local_results(value_container(value))``.
        """
        from torchstrategies.distribute.variables import Variable

        if self.variable_created_in_scope(value) or not isinstance(value, (torch.Tensor, Variable)):
            return value
        tensor = value._components[0] if isinstance(value, Variable) and len(value.values) == 1 else value
        for v in list(self._created_vars.values()):
            if isinstance(v, Variable) and any(c is tensor for c in v.values):
                return v
        return value

    def _register_created_variable(self, v: object) -> None:
        try:
            self._created_vars[id(v)] = v
        except TypeError:
            pass

    # -- running ----------------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Callable[..., object], args: tuple, kwargs: dict) -> Any:
        strategy = self._container_strategy()
        if kwargs or any(isinstance(a, _NESTED) or type(a) in pytree.SUPPORTED_NODES for a in args):
            args, kwargs = select_replica(0, (args, kwargs))
        with ReplicaContext(strategy, self._replica_id_offset, 0):
            return fn(*args, **kwargs)

    def _merge_call(
        self, replica_context: ReplicaContext, merge_fn: Callable[..., object], args: tuple, kwargs: dict
    ) -> Any:
        strategy = self._container_strategy()
        mode = _Mode(strategy, None, strategy, is_default=self._is_default)
        push_mode(mode)
        try:
            return merge_fn(strategy, *args, **kwargs)
        finally:
            pop_mode(mode)

    # -- communication hooks ----------------------------------------------------------------------
    def _reduce(self, op: ReduceOp, value: Reducible) -> Any:
        return self._reduce_to(op, value, self._reduce_device, None)

    def _reduce_to(
        self, op: ReduceOp, value: Reducible, destinations: Destinations | None, options: CommunicationOptions | None
    ) -> Any:
        comps = local_results(value)
        if not isinstance(value, DistributedValues) and op == ReduceOp.SUM and self._num_replicas_in_sync > 1:
            # TF's reduce_non_distributed_value, checked before the destinations as TF does.
            raise ValueError(
                f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op {op}."
            )
        dests = self._destination_devices(destinations)
        if not isinstance(value, DistributedValues) or len(comps) == 1:
            return self._to_destinations(torch.as_tensor(comps[0]), dests)
        raise NotImplementedError(
            f"{type(self).__name__} must implement _reduce_to for {len(comps)} components"
        )

    def _batch_reduce_to(
        self, op: ReduceOp, pairs: list[tuple[Reducible, Destinations]], options: CommunicationOptions | None
    ) -> list[Any]:
        return [self._reduce_to(op, v, d, options) for v, d in pairs]

    def _gather_to(
        self, value: Reducible, destinations: Destinations | None, axis: int, options: CommunicationOptions | None
    ) -> Any:
        comps = [torch.as_tensor(c) for c in local_results(value)]
        dests = self._destination_devices(destinations)
        out = torch.cat([c.to(dests[0]) for c in comps], dim=axis) if len(comps) > 1 else comps[0]
        return self._to_destinations(out, dests)

    def _update(
        self,
        var: Variable | torch.Tensor | DistributedValues[object],
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        group: bool,
    ) -> Any:
        results = []
        with torch.no_grad():
            for i, comp in enumerate(self._update_components(var)):
                results.append(fn(comp, *select_replica(i, args), **select_replica(i, kwargs)))
        if group:
            return regroup(results, Mirrored)
        return PerReplica(results) if len(results) > 1 else results[0]

    def _update_components(self, var: Variable | torch.Tensor | DistributedValues[object]) -> tuple[object, ...]:
        from torchstrategies.distribute.variables import DistributedVariable, component_variables

        if isinstance(var, DistributedVariable):
            return component_variables(var)  # fn gets a variable, as in TF
        return local_results(var)

    def _local_results(self, value: object) -> tuple[Any, ...]:
        from torchstrategies.distribute.variables import DistributedVariable

        if isinstance(value, DistributedVariable):
            return value.values  # TF: a distributed variable's local results are its components
        return local_results(value, self._num_local_replicas)

    # -- destinations -----------------------------------------------------------------------------
    def _destination_devices(self, destinations: Destinations | None) -> tuple[torch.device, ...]:
        if destinations is None:
            return (self._reduce_device,)
        if isinstance(destinations, DistributedValues):
            return tuple(_to_device(torch.as_tensor(c).device) for c in destinations.values)
        if isinstance(destinations, torch.Tensor):
            return (destinations.device,)
        if isinstance(destinations, (str, torch.device)):
            return (_to_device(destinations),)
        if isinstance(destinations, (tuple, list)) and destinations:
            return tuple(_to_device(d) for d in destinations)
        raise ValueError(f"destinations can not be empty or of unknown type: {destinations!r}")

    @staticmethod
    def _to_destinations(t: torch.Tensor, dests: tuple[torch.device, ...]) -> torch.Tensor | Mirrored[torch.Tensor]:
        if len(dests) == 1:
            return t.to(dests[0])
        return Mirrored(tuple(t.to(d) for d in dests))

    # -- creation hooks ---------------------------------------------------------------------------
    def _track_module(self, module: torch.nn.Module) -> None:
        with self._lock:
            if id(module) in self._tracked_ids:
                return
            self._tracked_ids.add(id(module))
            self._tracked_modules.append(weakref.ref(module))

    def _flush_created(self) -> None:
        """Hands fully constructed root modules made in scope to ``_on_module_created``."""
        if not self._tracked_modules:  # nothing made in scope since the last flush (every run checks)
            return
        with self._lock:
            mods = [m for m in (r() for r in self._tracked_modules) if m is not None]
            self._tracked_modules.clear()
            self._tracked_ids.clear()
        if not mods:
            return
        children: set[int] = set()
        for m in mods:
            for c in m.modules():
                if c is not m:
                    children.add(id(c))
        for m in mods:
            if id(m) not in children:
                if _is_keras(m):
                    self._on_keras_module(m)
                self._on_module_created(m)

    def _create_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        return None

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor | None:
        return None

    def _on_module_created(self, module: torch.nn.Module) -> None:
        return None

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def _on_keras_module(self, module: torch.nn.Module) -> None:
        """A top-level Keras 3 layer or model made in the scope (before ``_on_module_created``). By default
        refused with several replicas: ``Model.fit`` runs its own loop, outside ``strategy.run`` and the
        gradient rule (Mirrored, CentralStorage and MultiWorkerMirrored override this: ``strategies/_keras.py``)."""
        if self._num_replicas_in_sync < 2:
            return
        raise NotImplementedError(
            f"A Keras model ({type(module).__name__}) was made in the scope of {self._container_strategy()!r}: "
            "torchstrategies does not distribute Keras 3 models under this strategy (Model.fit runs its own "
            "loop, so the replicas would not train as one model). Keras' fit is supported under "
            "MirroredStrategy, CentralStorageStrategy and MultiWorkerMirroredStrategy (docs/keras.md); or "
            "write the training step in PyTorch and run it with strategy.run")

    def _create_variable(
        self, initial_value: torch.Tensor, synchronization: VariableSynchronization,
        aggregation: VariableAggregation, trainable: bool, name: str | None
    ) -> Variable:
        from torchstrategies.distribute.variables import _create_local_variable

        return _create_local_variable(self, initial_value, synchronization, aggregation, trainable, name)

    # -- input hooks ------------------------------------------------------------------------------
    def _input_workers(self) -> tuple[int, int]:
        """(num_input_pipelines, input_pipeline_id) of this process."""
        return 1, 0

    def _input_max_over_pipelines(self, values: list[int]) -> list[int]:
        """Element-wise MAX of ``values`` over every input pipeline (how per-worker input agrees on when an
        epoch ends). One pipeline: ``values`` as they are; a multi-worker strategy all-reduces them."""
        return values

    def _experimental_distribute_dataset(
        self, dataset: Iterable[object], options: InputOptions | None
    ) -> Iterable[Any]:
        from torchstrategies.distribute.input_lib import DistributedDataset

        return DistributedDataset(self._container_strategy(), dataset, options)

    def _distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[object]], options: InputOptions | None
    ) -> DistributedDatasetsFromFunction:
        from torchstrategies.distribute.input_lib import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self._container_strategy(), dataset_fn, options)

    def _experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], object]
    ) -> Any:
        outs = [
            value_fn(ValueContext(self._replica_id_offset + i, self._num_replicas_in_sync))
            for i in range(self._num_local_replicas)
        ]
        return regroup(outs, PerReplica)


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
