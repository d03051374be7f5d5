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

import logging
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchstrategies._ext import _C
from torchstrategies.distribute import context
from torchstrategies.distribute.context import _Mode
from torchstrategies.distribute.cross_device_ops import (
    CrossDeviceOps,
    ReductionToOneDevice,
    destination_devices,
    select_cross_device_ops,
)
from torchstrategies.distribute.distribute_lib import ReplicaContext, Strategy, StrategyExtended
from torchstrategies.distribute.mirrored_run import (
    _acting,
    _local,
    call_for_each_replica,
    in_replica_thread,
    merge_call_in_replica_thread,
)
from torchstrategies.distribute.replicated import ReplicaSlot, ReplicaSlots
from torchstrategies.distribute.values import DistributedValues, PerReplica, local_results
from torchstrategies.ops import FLOAT_DTYPES
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies._step_once import install_step_once_support
from torchstrategies.strategies.one_device import canonical_device

__all__ = ["MirroredStrategy", "MirroredExtended"]

_log = logging.getLogger("torchstrategies.strategies")

# Dtypes whose sequential torch adds equal the default accumulation kernel bit for bit (it accumulates
# float16/bfloat16 in float32, so those keep the kernel).
_FOREACH_EXACT = (torch.float32, torch.float64)

_PlanEntry = tuple[int, ReplicaSlot, Any]  # aggregate_gradients: (index in params, slot, common device)


def _default_devices() -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu:0"]


def _parse_devices(devices: Sequence[Any]) -> tuple[tuple[str, ...], tuple[torch.device, ...]]:
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


_guard_installed = False
_STEP_CLOSURE = (
    "optimizer.step(closure) is not supported inside strategy.run: compute the loss and call backward() in the "
    "step function, then optimizer.step()"
)
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_profiler_enabled = torch._C._autograd._profiler_enabled


def _install_outside_scope_guard() -> None:
    """A global optimizer step pre-hook: stepping, inside ``run``, an optimizer that was created outside
    the scope but holds replicated parameters would update replica copies one by one; refuse it."""
    global _guard_installed
    if _guard_installed:
        return

    def guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(opt, "_torchstrategies_seen", False):
            return
        mode = context.current_mode()
        if mode.replica_context is None or mode.cross_replica is not None or mode.is_default:
            return
        slots = getattr(mode.replica_context.strategy.extended, "_slots", None)
        if not isinstance(slots, ReplicaSlots):
            return
        for group in opt.param_groups:
            for p in group["params"]:
                if slots.contains(p):
                    raise RuntimeError(
                        f"{type(opt).__name__}.step() was called inside strategy.run on an optimizer "
                        "created outside "
                        "`with strategy.scope():` whose parameters were created inside it; create the "
                        "optimizer "
                        "inside the scope so that its step aggregates the replicas' gradients"
                    )

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(guard)
    _guard_installed = True


class MirroredExtended(StrategyExtended):
    """In-process replicas: parameters/buffers with per-replica slots, replica threads, cross-device ops."""

    def __init__(
        self, devices: Sequence[Any], cross_device_ops: CrossDeviceOps | None, parameter_device: Any = None
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
        # One replica computing where the variables live: no per-replica state at all.
        self._single_on_variable_device = self._worker_devices == (self._variable_device,)
        self.merge_call_timeout: float | None = None
        self._roots: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        # What _refresh_slots saw last (it holds those tensors until a module or optimizer dies or they change)
        self._watch = _C.TensorWatch()
        watch = self._watch
        self._forget_watched = lambda _ref: watch.clear()  # a module or optimizer died (no cycle via self)
        self._slots = ReplicaSlots(self._worker_devices, self._cross_device_ops)
        # aggregate_gradients' plans: id(params list) -> (slots generation, the list's tensor ids, plans)
        self._plans: dict[int, tuple[int, list[int], list[_PlanEntry], list[_PlanEntry]]] = {}
        _install_outside_scope_guard()
        install_step_once_support()

    # -- running ----------------------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self._single_on_variable_device:
            return super()._call_for_each_replica(fn, args, kwargs)  # nothing differs between replicas
        self._refresh_slots()
        if self._num_local_replicas == 1 and not self._slots.swaps:
            return super()._call_for_each_replica(fn, args, kwargs)
        return call_for_each_replica(
            self._container_strategy(), fn, args, kwargs, self.merge_call_timeout, self._slots
        )

    def replica_components(self, t: torch.Tensor) -> list[torch.Tensor | None]:
        """The tensors replica 0..N-1 compute with for parameter or buffer ``t`` (``t`` itself where a
        replica shares the primary's storage; None where a replica has not used its copy yet)."""
        self._refresh_slots()
        return self._slots.components(t)

    def _refresh_slots(self) -> None:
        """Finds the replicated tensors: parameters and buffers of the modules made (or deep-copied) in
        scope, and the parameters of the optimizers made in scope, whatever torch did to them since.

        ``_C.TensorWatch`` first compares, in C, the tensors the modules and optimizers hold now with those
        of the previous run (every run, object identities); the walk below runs only when they differ.
        """
        if self._slots.n > 1 and not self._watch.changed(self._roots, self._optimizers):
            return  # the very tensors of the previous run (one replica: devices decide what swaps, below)
        self._roots = [r for r in self._roots if r() is not None]
        self._optimizers = [o for o in self._optimizers if o() is not None]
        params: list[torch.Tensor | None] = []
        buffers: list[torch.Tensor | None] = []
        for r in self._roots:
            root = r()
            if root is None:
                continue
            stack = [root]
            seen: set[int] = set()
            while stack:  # root.modules() in pre-order, without its generators and name prefixes
                m = stack.pop()
                if id(m) in seen:
                    continue
                seen.add(id(m))
                if m._parameters:
                    params.extend(m._parameters.values())
                if m._buffers:
                    buffers.extend(m._buffers.values())
                if m._modules:
                    stack.extend(c for c in reversed(m._modules.values()) if c is not None)
        for o in self._optimizers:
            opt = o()
            if opt is not None:
                for group in opt.param_groups:
                    params.extend(group["params"])
        self._slots.refresh(params, buffers)
        self._plans.clear()  # (they hold slots: none may keep a replaced tensor's gradients alive)

    def _merge_call(self, replica_context: ReplicaContext, merge_fn: Any, args: tuple, kwargs: dict) -> Any:
        if in_replica_thread():
            return merge_call_in_replica_thread(merge_fn, args, kwargs)
        return super()._merge_call(replica_context, merge_fn, args, kwargs)

    # -- communication ----------------------------------------------------------------------------
    def _reduce_to(self, op: ReduceOp, value: Any, destinations: Any, options: Any) -> Any:
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

    def _batch_reduce_to(self, op: ReduceOp, pairs: list[tuple[Any, Any]], options: Any) -> list[Any]:
        if all(isinstance(v, DistributedValues) for v, _ in pairs):
            return self._cross_device_ops.batch_reduce(
                op, [(v, destination_devices(d)) for v, d in pairs], options
            )
        return [self._reduce_to(op, v, d, options) for v, d in pairs]

    def _gather_to(self, value: Any, destinations: Any, axis: int, options: Any) -> Any:
        dests = destination_devices(destinations if destinations is not None else self._reduce_device)
        comps = [torch.as_tensor(c) for c in local_results(value)]
        out = (
            torch.cat([c.to(dests[0]) for c in comps], dim=axis) if len(comps) > 1 else comps[0].to(dests[0])
        )
        return self._cross_device_ops.broadcast(out, dests)

    def _update_components(self, var: Any) -> tuple[Any, ...]:
        if self._slots.contains(var):
            return (var,)  # the primary; replica copies refresh from it
        comps = getattr(var, "_components", None)
        if comps is not None:
            return tuple(comps)
        return local_results(var)

    # -- creation ---------------------------------------------------------------------------------
    def _create_parameter(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> Any:
        if torch.nn.parameter.is_lazy(param) or param.device == self._variable_device:
            return None  # a lazy module's parameter is replaced when it materializes
        with torch.no_grad():
            return torch.nn.Parameter(param.detach().to(self._variable_device), param.requires_grad)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor) -> Any:
        if torch.nn.parameter.is_lazy(buffer) or buffer.device == self._variable_device:
            return None
        return buffer.detach().to(self._variable_device)

    def _on_module_created(self, module: torch.nn.Module) -> None:
        self._roots.append(weakref.ref(module, self._forget_watched))

    def _create_variable(
        self,
        initial_value: torch.Tensor,
        synchronization: Any,
        aggregation: Any,
        trainable: bool,
        name: str | None,
    ) -> Any:
        from torchstrategies.distribute.variables import create_distributed_variable

        return create_distributed_variable(self, initial_value, synchronization, aggregation, trainable, name)

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        ext_ref = weakref.ref(self)
        self._optimizers.append(weakref.ref(optimizer, self._forget_watched))

        def zero_grad(opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            if (
                set_to_none is True
                and type(opt).zero_grad is _TORCH_ZERO_GRAD
                and (_acting.replica or _local.replica) is not None  # (in_replica_thread(), inline)
                and hasattr(opt, "_zero_grad_profile_name")
                and not _profiler_enabled()
                and not torch.compiler.is_compiling()
            ):
                # A replica's zero_grad (once per replica per step): what torch's does with set_to_none,
                # without its record_function and dynamo wrappers (kept whenever a profiler records, or
                # dynamo traces); in C unless a parameter is a tensor subclass.
                if not _C.clear_gradients(opt.param_groups):
                    for group in opt.param_groups:
                        for p in group["params"]:
                            if p.grad is not None:
                                p.grad = None
                return
            type(opt).zero_grad(opt, set_to_none)
            ext = ext_ref()
            if ext is not None and not in_replica_thread():
                # cross-replica context: the replicas' gradients are cleared too, as one device's would be
                for group in opt.param_groups:
                    for p in group["params"]:
                        ext._slots.clear_replica_gradients(p)

        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]

        def step(opt: torch.optim.Optimizer, closure: Any = None) -> Any:
            ext = ext_ref()
            if ext is None:
                return type(opt).step(opt, closure)
            # current_replica(), inline: a replica of a scheduled run (replica context, by construction)
            replica = _acting.replica or _local.replica
            if replica is not None and replica.run.strategy._extended is ext:
                if closure is not None:
                    raise ValueError(_STEP_CLOSURE)
                # what rc.merge_call reaches for such a replica, without its checks
                return merge_call_in_replica_thread(optimizer_step, (), {}, replica)
            mode = context.current_mode()
            rc = mode.replica_context
            if rc is not None and mode.cross_replica is None and rc._strategy._extended is ext:
                if closure is not None:
                    raise ValueError(_STEP_CLOSURE)
                return rc.merge_call(optimizer_step)
            return ext._apply_optimizer_step(opt, closure)

        opt_ref = weakref.ref(optimizer)

        def optimizer_step(strategy: Any) -> Any:  # the merge function: one update from the replicas' sum
            ext, opt = ext_ref(), opt_ref()
            assert ext is not None and opt is not None  # both alive: a replica is inside opt.step()
            return ext._apply_optimizer_step(opt, None)

        optimizer_step.__qualname__ = f"{type(optimizer).__name__}.step"

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def _apply_optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        """Sums the replicas' gradients into the primaries' ``.grad`` and applies the update once."""
        if self._single_on_variable_device:
            return type(optimizer).step(optimizer, closure)
        groups = optimizer.param_groups
        if len(groups) == 1:
            self.aggregate_gradients(groups[0]["params"])
        else:
            params = []
            seen: set[int] = set()
            for group in groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self.aggregate_gradients(params)
        return type(optimizer).step(optimizer, closure)

    def _gradient_plan(self, params: Sequence[torch.Tensor]) -> tuple[list[_PlanEntry], list[_PlanEntry]]:
        """``(index in params, slot, device)`` for each replicated parameter of ``params`` (first occurrence);
        ``device`` is the parameter's device when every replica computes there (else None). Two lists: the
        entries ``_C.sum_replica_gradients`` may sum (the default reduction, every replica on the
        parameter's CPU device), then the others. Cached per ``params`` list while it holds the same
        tensors and the replicated set is unchanged."""
        slots = self._slots
        ids = list(map(id, params))
        cached = self._plans.get(id(params))
        if cached is not None and cached[0] == slots.generation and cached[1] == ids:
            return cached[2], cached[3]
        ops = self._cross_device_ops
        local = type(ops) is ReductionToOneDevice and ops.reduce_to_device is None
        in_c: list[_PlanEntry] = []
        other: list[_PlanEntry] = []
        seen: set[int] = set()
        workers = self._worker_devices
        for i, p in enumerate(params):
            slot = slots.slot(p)
            if slot is None or id(p) in seen:
                continue
            seen.add(id(p))
            device = p.device
            on_device = len(workers) > 1 and all(d == device for d in workers)
            entry = (i, slot, device if on_device else None)
            (in_c if local and on_device and device.type == "cpu" else other).append(entry)
        if len(self._plans) >= 16:
            self._plans.clear()
        self._plans[id(params)] = (slots.generation, ids, in_c, other)
        return in_c, other

    def aggregate_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sets each replicated parameter's ``.grad`` to the SUM of its replicas' gradients."""
        if type(params) is not list:
            params = list(params)
        in_c, plan = self._gradient_plan(params)
        if in_c:
            # Float32/float64 CPU gradients: summed in C (csrc/cpu/replica_grads.cpp); what it leaves
            # (other dtypes, non-contiguous gradients, a replica without one, ...) is summed below.
            left = _C.sum_replica_gradients(params, in_c)
            if left is None:  # a new tensor where a dead one was (same id): plan anew
                self._plans.clear()
                return self.aggregate_gradients(params)
            if left:
                plan = left + plan
        if not plan:
            return
        ops = self._cross_device_ops
        # The default reduction with every replica on the parameter's device (replicas on one device, as on
        # CPU): float32/float64 gradients are summed in one foreach call per replica, without building
        # PerReplica values and destinations.
        local = type(ops) is ReductionToOneDevice and ops.reduce_to_device is None
        strided = torch.strided
        n = self._num_local_replicas
        fast: list[tuple[torch.Tensor, ReplicaSlot]] = []
        columns: list[list[torch.Tensor]] = [[] for _ in range(n)]
        rest: list[tuple[torch.Tensor, ReplicaSlot]] = []
        for i, slot, device in plan:
            p = params[i]
            held = slot.ref()
            if held is None or held is not p:  # a new tensor where a dead one was (same id): plan anew
                self._plans.clear()
                return self.aggregate_gradients(params)
            grads = slot.grads
            if local and device is not None and p.device == device:
                dtype = p.dtype
                if dtype in _FOREACH_EXACT:
                    for g in grads:
                        # (a gradient's shape and device follow the parameter's: torch checks them when it
                        # is set, and every replica computed on p's device)
                        if g is None or g.dtype is not dtype or g.layout is not strided:
                            break
                    else:
                        fast.append((p, slot))
                        for k in range(n):
                            columns[k].append(grads[k])  # type: ignore[arg-type]  # (no None: loop above)
                        continue
            rest.append((p, slot))
        if fast:
            # Sequential ((g0 + g1) + g2) ... in the gradients' own dtype: bit for bit what the default
            # accumulation kernel (EXPERIMENTAL_ACCUMULATE_N) computes for float32/float64.
            totals = torch._foreach_add(columns[0], columns[1])
            for k in range(2, n):
                torch._foreach_add_(totals, columns[k])
            nones = [None] * (n - 1)
            for (p, slot), total in zip(fast, totals, strict=True):
                p.grad = total
                grads = slot.grads  # hand_down (every replica is on p's device), in place
                grads[0] = total
                grads[1:] = nones
        if rest:
            self._aggregate_general(rest, local)

    def _aggregate_general(self, params: list[tuple[torch.Tensor, ReplicaSlot]], local: bool) -> None:
        """``aggregate_gradients`` for gradients that are missing on some replica, on other devices, of other
        dtypes or sparse: through ``cross_device_ops``, or its summing kernel where that needs no move."""
        slots = self._slots
        ops = self._cross_device_ops
        pairs, targets = [], []
        for p, slot in params:
            grads = slot.grads
            ref = next((g for g in grads if g is not None), None)
            if ref is None:
                continue  # nothing new from the replicas: keep the primary gradient
            if local and all(g is not None for g in grads):
                every = cast(list[torch.Tensor], grads)  # no None, checked just above
                dtype, shape, device = ref.dtype, ref.shape, p.device
                if (
                    dtype in FLOAT_DTYPES
                    and ref.layout == torch.strided
                    and all(g.dtype == dtype and g.shape == shape and g.device == device for g in every)
                ):
                    total = cast(ReductionToOneDevice, ops)._sum(list(every), None) if len(every) > 1 else ref.clone()
                    p.grad = total
                    slots.hand_down(slot, total)
                    continue
            full = [
                g if g is not None else torch.zeros_like(ref, device=self._worker_devices[i])
                for i, g in enumerate(grads)
            ]
            pairs.append((PerReplica(tuple(full)), (p.device,)))
            targets.append(p)
            slots.clear_replica_gradients(p)
        if not pairs:
            return
        summed = ops.batch_reduce(ReduceOp.SUM, pairs)
        for p, g in zip(targets, summed, strict=True):
            p.grad = g if isinstance(g, torch.Tensor) else g.values[0]
            slots.hand_down_gradient(p)


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one process (``tf.distribute.MirroredStrategy``).

    One replica per device, running ``fn`` one at a time as TF does (replica 0 in the calling thread; the
    others there too, or on worker threads once replica 0 reaches a merge_call). Parameters created in
    ``scope()`` are mirrored: replica i computes with its own copy on device i; inside ``run``,
    ``optimizer.step()`` sums the replicas' gradients with ``cross_device_ops`` and applies one update
    that every replica sees. Buffers are sync-on-read (MEAN).

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
        devices: Sequence[Any] | None = None,
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
        self._run_mode = _Mode(self, None, self, is_default=False)  # the cross-replica mode around run

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> Any:
        """``Strategy.run`` (which see). Called outside any scope with a tuple of arguments (the usual
        training loop), it does what ``with self.scope():`` does around the call (cross-replica mode, the
        scope depth, modules made in scope handed over before and after) without that context's per-call
        objects."""
        if kwargs or type(args) is not tuple or context.mode_stack() or not callable(fn):
            return super().run(fn, args, kwargs, options)
        ext = self._extended
        mode = self._run_mode
        context.push_mode(mode)
        with ext._lock:
            ext._scope_depth += 1
        try:
            ext._flush_created()
            return ext._call_for_each_replica(fn, args, {})
        finally:
            context.pop_mode(mode)
            with ext._lock:
                ext._scope_depth -= 1
                outermost = ext._scope_depth == 0
            if outermost:
                ext._flush_created()

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(cast(MirroredExtended, self._extended)._device_names)!r})"
