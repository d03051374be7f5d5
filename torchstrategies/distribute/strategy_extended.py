"""``StrategyExtended``: the extended API of a strategy and the hooks a strategy overrides (TF's
distribute_lib, the strategy author's side). Re-exported by ``distribute/distribute_lib.py``.

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
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute import creation, device_util
from torchstrategies.distribute.context import _Mode, current_mode, has_strategy, pop_mode, push_mode
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization
from torchstrategies.distribute.replica_context import ReplicaContext, ValueContext
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
    from torchstrategies.collectives.options import CommunicationOptions
    from torchstrategies.distribute.distribute_lib import Strategy
    from torchstrategies.distribute.input_lib import (
        DistributedDatasetsFromFunction,
        InputContext,
        InputOptions,
    )
    from torchstrategies.distribute.variables import Variable

__all__ = ["StrategyExtended", "require_cross_replica"]

_NESTED = (DistributedValues, list, tuple, dict)  # run arguments that may hold per-replica values


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
        from torchstrategies.distribute.distributed_variables import DistributedVariable
        from torchstrategies.distribute.variables import component_variables

        if isinstance(var, DistributedVariable):
            return component_variables(var)  # fn gets a variable, as in TF
        return local_results(var)

    def _local_results(self, value: object) -> tuple[Any, ...]:
        from torchstrategies.distribute.distributed_variables import DistributedVariable

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
