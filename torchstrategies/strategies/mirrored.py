"""``MirroredStrategy``: synchronous data parallelism over the devices of this process, replicas in threads.

Example:
    >>> import torch, torchstrategies as ts
    >>> s = ts.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> with s.scope():
    ...     model = torch.nn.Linear(4, 1)
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(x, y):
    ...     opt.zero_grad()
    ...     loss = ts.compute_average_loss((model(x) - y).pow(2).sum(1))
    ...     loss.backward()
    ...     opt.step()                      # gradients summed across replicas, one update
    ...     return loss
    >>> data = s.experimental_distribute_dataset([(torch.ones(8, 4), torch.zeros(8, 1))])
    >>> for x, y in data:
    ...     total = s.reduce("sum", s.run(step, args=(x, y)), axis=None)
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from torchstrategies.distribute import context
from torchstrategies.distribute.creation import OPTIMIZERS
from torchstrategies.distribute.cross_device_ops import (
    CrossDeviceOps,
    destination_devices,
    select_cross_device_ops,
)
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.distribute_lib import ReplicaContext, Strategy, StrategyExtended
from torchstrategies.distribute.distributed_variables import create_distributed_variable
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization
from torchstrategies.distribute.input_lib import InputOptions
from torchstrategies.distribute.mirrored_run import (
    call_for_each_replica,
    current_replica,
    merge_call,
    replicas_running,
)
from torchstrategies.distribute.replica_share import STEP_CLOSURE, guard_embedding, guard_register_hook
from torchstrategies.distribute.replicated import ReplicatedTensors
from torchstrategies.distribute.torch_patches import PatchSet, wrap_attribute
from torchstrategies.distribute.values import Destinations, DistributedValues, Reducible, local_results
from torchstrategies.distribute.variables import Variable, component_variables
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies import _keras
from torchstrategies.strategies._metric_schedulers import in_process_plateau_step
from torchstrategies.strategies._mw_input import ReplicaSplitDataset, is_map_style_loader, loader_seed
from torchstrategies.strategies._scheduler_steps import wrap_scheduler_steps
from torchstrategies.strategies.one_device import canonical_device

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.collectives.options import CommunicationOptions

__all__ = ["MirroredStrategy", "MirroredExtended"]


def _default_devices() -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu:0"]


def _parse_devices(
    devices: DeviceLike | Sequence[DeviceLike],
) -> tuple[tuple[str, ...], tuple[torch.device, ...]]:
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError(
            "Got an empty `devices` list. Please make sure the `devices` you pass in is not empty."
        )
    parsed = [canonical_device(d) for d in devices]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"No duplicates allowed in `devices` argument: {devices}")
    for d in devices:
        canonical_device(d, must_exist=True)  # a device this machine lacks fails here, not at first use
    return tuple(names), tuple(p for _, p in parsed)


def _outside_scope_guard(opt: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """A global optimizer step pre-hook. In replica context of a strategy: an optimizer made in another
    strategy's scope is an error (as nested scopes of two strategies are); inside ``run`` of an in-process
    strategy with several replicas, an optimizer made outside any scope would step once per replica."""
    owner = OPTIMIZERS.owner(opt)
    mode = context.current_mode()
    if owner is not None and not mode.is_default and mode.replica_context is not None and (
        owner is not mode.strategy.extended
    ):
        raise RuntimeError(
            f"Mixing different tf.distribute.Strategy objects: {type(opt).__name__} was created in the scope "
            f"of {owner._container_strategy()!r} and is stepped inside {mode.strategy!r}.run. Create the "
            "model and the optimizer in the scope of the strategy that runs the step"
        )
    replica = current_replica()
    if replica is None or OPTIMIZERS.made_in_a_scope(opt) or len(replica.run.devices) < 2:
        return
    raise RuntimeError(
        f"{type(opt).__name__}.step() was called inside strategy.run on an optimizer created outside "
        "`with strategy.scope():`; it would step once per replica. Create the model and the optimizer "
        "inside the scope, so that the step sums the replicas' gradients and updates once"
    )


def _summed_gradients(strategy: Strategy) -> None:
    """The merge function of ``loss.backward()`` in an in-process replica: nothing to do; the fold before
    every merge makes each ``.grad`` the replicas' sum and hands it to every replica."""


_summed_gradients._torchstrategies_merge_key = "backward"  # type: ignore[attr-defined]


class _Depth(threading.local):
    depth = 0


_nested = _Depth()  # backward calls running in this thread


def _synced_backward(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.backward`` (``Tensor.backward`` calls it) as the in-process replicas need it: inside
    a replica of a strategy with several replicas it is followed by a merge_call, so when it returns every
    ``.grad`` of a replicated parameter is the cross-replica sum, as DDP and one device give. Before it, a
    replica k > 0 drops the sum it was handed, so gradient accumulation adds each replica's new gradient
    once."""

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        replica = current_replica()
        if replica is None or _nested.depth:  # (a backward inside a backward: reentrant checkpointing)
            return orig(*args, **kwargs)
        replica.run.views.release()
        _nested.depth += 1
        try:
            result = orig(*args, **kwargs)
        finally:
            _nested.depth -= 1
        merge_call(replica, _summed_gradients, (), {})
        return result

    return backward


def _once_per_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig`` as a merge_call inside an in-process replica: it runs once per step, in cross-replica
    context, on the replicas' summed gradients (GradScaler.unscale_/step/update: a non-finite gradient on
    any replica makes the sum non-finite, so no replica steps and the scale is updated once, TF's
    LossScaleOptimizer rule; LRScheduler.step: the schedule advances once)."""

    @functools.wraps(orig)
    def method(self: object, *args: object, **kwargs: object) -> Any:
        replica = current_replica()
        if replica is None:
            return orig(self, *args, **kwargs)

        def once(strategy: Strategy) -> object:
            return orig(self, *args, **kwargs)

        once._torchstrategies_merge_key = (id(self), orig.__name__)  # type: ignore[attr-defined]
        return merge_call(replica, once, (), {})

    return method


def _per_replica_setattr(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.__setattr__``: inside an in-process replica, a plain attribute of a module made in the
    scope becomes the replica's own (``distribute/replica_attributes.py``: a stateful RNN's hidden state)."""

    @functools.wraps(orig)
    def __setattr__(self: torch.nn.Module, name: str, value: Any) -> None:
        replica = current_replica()
        if replica is not None:
            replicated = replica.run.replicated
            replicated.attributes.written(self, name, value, replicated.module_ids)
        orig(self, name, value)

    return __setattr__


def _in_replicas(param: torch.Tensor) -> bool:
    """Whether a gradient computed now is one replica's share (``distribute/replica_share.py``)."""
    return replicas_running() > 1


# torch's globals the in-process strategies need while one lives (distribute/torch_patches.py); each
# optimizer class made in a scope has its ``step`` wrapped too (``_merged_step``), undone with the set.
PATCHES = PatchSet("in-process replicas", [
    lambda: register_optimizer_step_pre_hook(_outside_scope_guard).remove,
    lambda: wrap_attribute(torch.autograd, "backward", _synced_backward),
    *(functools.partial(wrap_attribute, torch.amp.GradScaler, name, _once_per_step)
      for name in ("unscale_", "step", "update")),
    lambda: wrap_scheduler_steps(_once_per_step, in_process_plateau_step),  # every class's own step
    lambda: wrap_attribute(torch.nn.Module, "__setattr__", _per_replica_setattr),
    lambda: wrap_attribute(torch.Tensor, "register_hook", guard_register_hook(_in_replicas)),
    lambda: wrap_attribute(torch.Tensor, "register_post_accumulate_grad_hook",
                           guard_register_hook(_in_replicas, post_accumulate=True)),
    *(functools.partial(wrap_attribute, torch.nn.functional, name, guard_embedding(_in_replicas))
      for name in ("embedding", "embedding_bag")),
])


class MirroredExtended(StrategyExtended):
    """In-process replicas: a component of every parameter and buffer per replica, replica threads,
    cross-device ops (``distribute/mirrored_run.py``, ``distribute/replicated.py``)."""

    def __init__(
        self,
        devices: DeviceLike | Sequence[DeviceLike],
        cross_device_ops: CrossDeviceOps | None,
        parameter_device: DeviceLike | None = None,
    ):
        super().__init__()
        self._device_names, self._worker_devices = _parse_devices(devices)
        self._num_replicas_in_sync = len(self._worker_devices)
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a CrossDeviceOps instance, got {cross_device_ops!r}")
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._worker_devices)
        if parameter_device is None:
            self._variable_device = self._worker_devices[0]
        else:
            self._variable_device = canonical_device(parameter_device)[1]
        self._parameter_devices = (self._variable_device,)
        self.merge_call_timeout: float | None = None
        self._replicated = ReplicatedTensors(self._worker_devices, self._cross_device_ops)
        # One replica computing where the variables live: it computes with them as they are.
        self._one_view = self._worker_devices == (self._variable_device,)
        # The optimizers made in this scope whose step is merged (``_merged_step``): held here, keyed weakly,
        # nothing written on the user's object.
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._torch_leases.append(PATCHES.acquire(self))

    # -- running ----------------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Callable[..., object], args: tuple, kwargs: dict) -> Any:
        if self._one_view:
            return super()._call_for_each_replica(fn, args, kwargs)
        self._replicated.refresh()
        return call_for_each_replica(
            self._container_strategy(), fn, args, kwargs, self._replicated, self.merge_call_timeout
        )

    def _merge_call(
        self, replica_context: ReplicaContext, merge_fn: Callable[..., object], args: tuple, kwargs: dict
    ) -> Any:
        replica = current_replica()
        if replica is not None and replica.run.strategy is self._container_strategy():
            return merge_call(replica, merge_fn, args, kwargs)
        return super()._merge_call(replica_context, merge_fn, args, kwargs)

    def replica_components(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The tensors replica 0..N-1 compute with for parameter or buffer ``t`` (``t`` itself where that
        is the primary; ``[t]`` for a tensor that is not replicated)."""
        if self._one_view:
            return [t]
        self._replicated.refresh()
        return self._replicated.components(t)

    def _replicated_of(self, optimizer: torch.optim.Optimizer) -> ReplicatedTensors | None:
        """This strategy's replicated tensors if ``optimizer`` was made in its scope, else None."""
        return self._replicated if optimizer in self._optimizers else None

    # -- communication ----------------------------------------------------------------------------
    def _reduce_to(
        self, op: ReduceOp, value: Reducible, destinations: Destinations | None, options: CommunicationOptions | None
    ) -> Any:
        dests = destination_devices(destinations if destinations is not None else self._reduce_device)
        if not isinstance(value, DistributedValues):
            # TF's reduce_non_distributed_value.
            if isinstance(value, (int, float)) and value == 0:
                return 0
            if op == ReduceOp.SUM and self._num_replicas_in_sync != 1:
                raise ValueError(
                    f"A non-DistributedValues value {value!r} cannot be reduced with the given reduce op "
                    f"{op}."
                )
            return self._cross_device_ops.broadcast(torch.as_tensor(value), dests)
        return self._cross_device_ops.reduce(op, value, dests, options)

    def _batch_reduce_to(
        self, op: ReduceOp, pairs: list[tuple[Reducible, Destinations]], options: CommunicationOptions | None
    ) -> list[Any]:
        if all(isinstance(v, DistributedValues) for v, _ in pairs):
            return self._cross_device_ops.batch_reduce(
                op, [(v, destination_devices(d)) for v, d in pairs], options
            )
        return [self._reduce_to(op, v, d, options) for v, d in pairs]

    def _gather_to(
        self, value: Reducible, destinations: Destinations | None, axis: int, options: CommunicationOptions | None
    ) -> Any:
        dests = destination_devices(destinations if destinations is not None else self._reduce_device)
        comps = [torch.as_tensor(c) for c in local_results(value)]
        out = (
            torch.cat([c.to(dests[0]) for c in comps], dim=axis) if len(comps) > 1 else comps[0].to(dests[0])
        )
        return self._cross_device_ops.broadcast(out, dests)

    def _update_components(self, var: Variable | torch.Tensor | DistributedValues[object]) -> tuple[object, ...]:
        if isinstance(var, torch.Tensor) and not isinstance(var, DistributedValues):
            return (var,)  # a replicated tensor: its primary (the components follow at their next turn)
        if isinstance(var, Variable):
            return component_variables(var)  # fn gets a variable, as under OneDevice and in TF
        return local_results(var)

    # -- creation ---------------------------------------------------------------------------------
    def _create_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        if torch.nn.parameter.is_lazy(param) or param.device == self._variable_device:
            return None  # a lazy module's parameter is replaced when it materializes
        with torch.no_grad():
            return torch.nn.Parameter(param.detach().to(self._variable_device), param.requires_grad)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor | None:
        if torch.nn.parameter.is_lazy(buffer) or buffer.device == self._variable_device:
            return None
        return buffer.detach().to(self._variable_device)

    def _on_module_created(self, module: torch.nn.Module) -> None:
        self._replicated.add_module(module)

    def _on_keras_module(self, module: torch.nn.Module) -> None:
        """A Keras 3 model made in the scope: ``fit`` runs Keras' step once per replica in ``run``
        (``_keras.py``); its weights are replicated by ``_on_module_created`` like any module's."""
        if _keras.is_keras_model(module):
            _keras.attach(self, module, in_process=True)

    def _create_variable(
        self, initial_value: torch.Tensor, synchronization: VariableSynchronization,
        aggregation: VariableAggregation, trainable: bool, name: str | None
    ) -> Variable:
        return create_distributed_variable(self, initial_value, synchronization, aggregation, trainable, name)

    # -- input ------------------------------------------------------------------------------------
    def _experimental_distribute_dataset(self, dataset: Iterable[object], options: InputOptions | None) -> Any:
        """A map-style DataLoader reads its global batches in MultiWorkerMirroredStrategy's order (seeded by
        the loader's generator), resumable from a checkpoint of either strategy; anything else as the core."""
        if is_map_style_loader(dataset):
            loader = cast(DataLoader, dataset)
            named = loader_seed(loader)
            seed = named if named is not None else int(torch.randint(0, 2**31 - 1, (1,)).item())
            return ReplicaSplitDataset(self._container_strategy(), loader, seed, options)
        return super()._experimental_distribute_dataset(dataset, options)

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """Its parameters are replicated, and its ``step()`` inside ``run`` becomes a merge_call: one
        update of the primaries from the replicas' summed gradients (``_merged_step``)."""
        self._replicated.add_optimizer(optimizer)
        self._optimizers.add(optimizer)
        if not getattr(type(optimizer).step, "_torchstrategies_wrapped", False):
            PATCHES.add(functools.partial(wrap_attribute, type(optimizer), "step", _merged_step))


def _replicated_of(optimizer: torch.optim.Optimizer) -> ReplicatedTensors | None:
    """The replicated tensors of the live in-process strategy whose scope made ``optimizer``, else None."""
    owner = OPTIMIZERS.owner(optimizer)
    return owner._replicated_of(optimizer) if isinstance(owner, MirroredExtended) else None


def _merged_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``orig``, an optimizer class's ``step`` (wrapped once per class, so no optimizer holds a method bound
    to itself), such that for an optimizer made in an in-process strategy's scope, a step inside ``run`` is
    a merge_call that updates once, in cross-replica context, and every step marks the parameters it wrote
    for the replicas' seed (fused optimizers move no version counter)."""

    @functools.wraps(orig)
    def step(self: torch.optim.Optimizer, *args: object, **kwargs: object) -> Any:
        replicated = _replicated_of(self)
        if replicated is None:
            return orig(self, *args, **kwargs)
        replica = current_replica()
        if replica is not None and replica.run.replicated is replicated:
            if any(a is not None for a in (*args, *kwargs.values())):
                raise ValueError(STEP_CLOSURE)
            return merge_call(replica, _update_of(self), (), {})
        result = orig(self, *args, **kwargs)
        replicated.mark_written([p for g in self.param_groups for p in g["params"]])
        return result

    step._torchstrategies_wrapped = True  # type: ignore[attr-defined]
    return step


def _update_of(optimizer: torch.optim.Optimizer) -> Callable[[Strategy], object]:
    """The merge function of ``optimizer.step()``: the replicas' buffers made equal (the one point per step
    where buffers are synchronized, docs/strategies.md), then one update from the summed gradients."""

    def update(strategy: Strategy) -> object:
        replicated = _replicated_of(optimizer)
        if replicated is not None:
            replicated.fold_buffers()
        return optimizer.step()  # (in cross-replica context: the update, and the mark for the seed)

    update.__qualname__ = f"{type(optimizer).__name__}.step"
    update._torchstrategies_merge_key = id(optimizer)  # type: ignore[attr-defined]
    return update


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one process (``tf.distribute.MirroredStrategy``).

    One replica per device, each on a thread of its own, running ``fn`` one at a time as TF does (replica
    0 in the calling thread). Parameters and buffers created in ``scope()`` have a component per replica,
    CPU replicas included: replica i computes with its own copy on device i; inside ``run``,
    ``optimizer.step()`` sums the replicas' gradients with ``cross_device_ops`` and applies one update
    that reaches every replica. Buffers are sync-on-read (MEAN).

    Args:
        devices: device names, e.g. ``["cuda:0", "cuda:1"]`` or, to test on a CPU-only machine,
            ``["cpu:0", "cpu:1", "cpu:2"]`` (all CPU names compute on the CPU). None: every GPU, else one
            CPU replica.
        cross_device_ops: a ``CrossDeviceOps``; None: NcclAllReduce on GPUs, ReductionToOneDevice on CPU.
        num_replicas: convenience for ``devices=["cpu:0", ..., f"cpu:{num_replicas-1}"]``.

    Raises:
        ValueError: duplicate or invalid devices, or both ``devices`` and ``num_replicas``.

    Example:
        >>> import torchstrategies as ts
        >>> ts.MirroredStrategy(num_replicas=3).num_replicas_in_sync
        3
    """

    def __init__(
        self,
        devices: DeviceLike | Sequence[DeviceLike] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        num_replicas: int | None = None,
    ):
        if num_replicas is not None:
            if devices is not None:
                raise ValueError(
                    f"Pass either devices or num_replicas, not both (got {devices!r}, {num_replicas!r})"
                )
            if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
                raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
            devices = [f"cpu:{i}" for i in range(num_replicas)]
        if devices is None:
            devices = _default_devices()
        super().__init__(MirroredExtended(devices, cross_device_ops))

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(cast(MirroredExtended, self._extended)._device_names)!r})"
