"""In-process replicas of parameters and buffers (MirroredStrategy, CentralStorageStrategy).

Every replica owns a component of every replicated tensor, on its own device, CPU replicas included, as a
TF MirroredVariable has one per device. The tensors stay the user's own ``nn.Parameter`` and buffer
objects; ``_C.ReplicaViews`` (csrc/cpu/replica_views.cpp, which says how) switches each one to the active
replica's component and gradient while that replica runs, and back to the primary (component 0, TF's
``_primary``) for cross-replica code. So a write inside ``run`` (an EMA teacher's update, BatchNorm's running
statistics) lands in the replica's own component once, and a write in cross-replica context (the optimizer
step in the merge, ``load_state_dict``) reaches every component before its replica runs again.

Whenever cross-replica code has run, its writes are copied into the components before a replica runs
again: at the start of each ``run`` every component is seeded from the primary (whatever user code did
between runs), and after a merge function the tensors it wrote (an optimizer's step included). Before
cross-replica code runs, the replicas' writes are folded into the primary (gradients before every merge,
everything at the end of ``run``):

* gradients are SUM (ON_READ): ``p.grad`` becomes the sum of the gradients the replicas have, through the
  strategy's ``CrossDeviceOps.sum_gradients`` (its ``AggregationMethod`` kernel, all parameters in one
  grouped call, into replica 0's own gradient in place where the kernel can); a parameter that no replica gave a
  gradient keeps ``.grad is None``; every replica then holds the sum (replica 0 the primary's gradient, the
  others a copy), and a fold that finds every replica still holding what it was handed sums nothing. A
  backward in replica k > 0 first drops its copy (``release``), so gradient accumulation across backward
  passes or steps (no ``zero_grad``) adds each gradient once, as on one device. ``loss.backward()`` inside
  ``run`` ends in a merge_call (``strategies/mirrored.py``), so after it every ``.grad`` is the sum;
* buffers declared MEAN (``distribute/buffers.py``: the running statistics of torch's normalization
  layers, and what ``ts.declare_buffer_aggregation`` declares) are ON_READ with MEAN: at every optimizer
  step (its merge) and at the end of ``run`` the primary becomes the replicas' mean and every component
  restarts from it. For the linear updates such buffers get (running averages) this equals TF's ON_READ
  value. (Inside another merge function a buffer reads as replica 0's component.) Every other buffer
  follows the parameters: the replicas must write the same value to it;
* writes in replica context: a parameter or a buffer not declared MEAN whose version moved, or whose data
  was replaced (``p.data = x``), while a replica ran is compared across the replicas at the next fold; copies
  that differ raise ``ReplicaDivergenceError`` naming it. Writes torch does not count (through ``p.data``)
  are found by a rotating slice: at every optimizer step (its merge) 1/``AGREEMENT_SLICES`` of the
  parameters' and buffers' bytes is compared across the replicas, all of it in debug mode. Every comparison
  goes through the agreement seam (``distribute/agreement.py``: the components' hashes, CPU and GPU alike);
* parameters are ON_WRITE with aggregation NONE (TF 2.x): a replica's write stays in its component, and a
  cross-replica read gives component 0's value.

Because nothing is a tensor subclass, whatever torch does to a module keeps working: ``copy.deepcopy`` in
the scope (the copies are found again through the module tree and the optimizers), ``.to()``,
``state_dict``, hooks, ``torch.func.functional_call`` and ``torch.compile``, which sees plain tensors.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]

from torchstrategies._ext import _C
from torchstrategies.collectives import debug as collective_debug
from torchstrategies.distribute import agreement
from torchstrategies.distribute.agreement_step import AGREEMENT_SLICES
from torchstrategies.distribute.buffers import is_mean_buffer, modules_of
from torchstrategies.distribute.replica_attributes import ReplicaAttributes
from torchstrategies.distribute.values import PerReplica
from torchstrategies.reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.distribute.cross_device_ops import CrossDeviceOps, Pairs

__all__ = ["ReplicatedTensors"]


class ReplicatedTensors:
    """The replicated tensors of one in-process strategy: what its modules and optimizers hold.

    Args:
        devices: the replicas' compute devices (index = local replica id).
        cross_device_ops: what sums gradients and averages buffers (``batch_reduce_implementation``).
    """

    def __init__(self, devices: tuple[torch.device, ...], cross_device_ops: CrossDeviceOps):
        self.views = _C.ReplicaViews(list(devices))
        self._ops = cross_device_ops
        self._modules: list[weakref.ref[torch.nn.Module]] = []
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._mean_ids: set[int] = set()   # the buffers declared MEAN, as of the last refresh
        self.module_ids: set[int] = set()  # the modules made in the scope, as of the last refresh
        self.attributes = ReplicaAttributes(len(devices))  # their plain attributes written in replicas
        # what the rotating slice covers: every other tensor, once (weakly: it keeps no model alive)
        self._compared: list[weakref.ref[torch.Tensor]] = []
        self.slices = 0 if not agreement.enabled() else 1 if collective_debug.enabled() else AGREEMENT_SLICES
        self.steps = 0   # optimizer steps (their merges) so far
        # The replicas' bookkeeping at a merge and at the end of a run (sums, folds, the agreement check) runs
        # eagerly when the step function is torch.compile'd: dynamo would trace its per-step Python (which
        # piece of the slice, which tensors moved) into graphs guarded on this step's values, recompiling at
        # every step until its recompile limit. Wrapped per instance, as MWMS's collectives are
        # (multi_worker_mirrored.py): importing torchstrategies imports no torch._dynamo.
        self.fold = torch.compiler.disable(self.fold)  # type: ignore[method-assign]
        self.fold_buffers = torch.compiler.disable(self.fold_buffers)  # type: ignore[method-assign]

    def add_module(self, module: torch.nn.Module) -> None:
        self._modules.append(weakref.ref(module))

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.append(weakref.ref(optimizer))

    def refresh(self) -> None:
        """Finds the parameters and buffers of the modules and optimizers made in scope as they are now (a
        submodule, parameter or param_group added or replaced since the last run included)."""
        modules = [m for m in (r() for r in self._modules) if m is not None]
        optimizers = [o for o in (r() for r in self._optimizers) if o is not None]
        if len(modules) != len(self._modules):
            self._modules = [weakref.ref(m) for m in modules]
        if len(optimizers) != len(self._optimizers):
            self._optimizers = [weakref.ref(o) for o in optimizers]
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        mean_ids: set[int] = set()
        walked = list(modules_of(*modules))   # every module under the roots, in pre-order, each once
        for m in walked:
            params.extend(p for p in m._parameters.values() if p is not None)
            for name, b in m._buffers.items():
                if b is not None:
                    buffers.append(b)
                    if is_mean_buffer(m, name):
                        mean_ids.add(id(b))
        lazy = [t for t in params + buffers if isinstance(t, UninitializedTensorMixin)]
        if lazy:
            raise RuntimeError(
                f"{len(lazy)} parameter(s) or buffer(s) of the modules made in the scope are not initialized "
                f"yet (a lazy module, e.g. {type(lazy[0]).__name__}): call the model once on a batch outside "
                "strategy.run (in or after `with strategy.scope():`) so that they take their shapes; each "
                "replica then gets its own copy"
            )
        for opt in optimizers:
            for group in opt.param_groups:
                params.extend(group["params"])
        self._mean_ids = mean_ids
        self.module_ids = {id(m) for m in walked}
        self.views.refresh(params, buffers)
        unique = {id(t): t for t in params + buffers if id(t) not in mean_ids}
        self._compared = [weakref.ref(t) for t in unique.values()]

    def fold(self, end: bool) -> None:
        """Aggregates what the replicas wrote into the primaries (cross-replica view; see the module doc):
        their gradients before every merge (a no-op for gradients every replica still holds as handed), the
        check of what they wrote, and at the ``end`` of a run their buffers (the ON_READ read) and the
        parameters they wrote."""
        pending = self.views.gradients_to_sum()
        if pending:
            totals = self._ops.sum_gradients([(p.device, grads) for p, grads in pending])
            self.views.set_gradients([p for p, _ in pending], totals)
        self.check_writes()
        if end:
            self.fold_buffers(parameters=True)

    def check_writes(self) -> None:
        """Raises if the replicas wrote a parameter (or a buffer not declared MEAN) in replica context and
        now hold different values of it; only the tensors whose version moved (or whose data was replaced)
        in replica context are compared."""
        items = [(t, comps) for t, comps in self.views.written() if len(comps) > 1 and not self._averaged(t)]
        agreement.check_replicas(items, f"optimizer step {self.steps + 1}", self.name_of, _written_cause)

    def check_slice(self) -> None:
        """Compares this step's slice of the replicated tensors across the replicas (see the module doc)."""
        compared = [t for t in (r() for r in self._compared) if t is not None]
        if not self.slices or not compared:
            return
        agreement.check_replica_piece([(t, self.views.components(t)) for t in compared], self.steps % self.slices,
                                      self.slices, f"optimizer step {self.steps + 1}", self.name_of,
                                      _uncounted_cause)

    def fold_buffers(self, parameters: bool = False) -> None:
        """Makes every replica's buffers equal: those declared MEAN become the replicas' mean, the others must
        agree (else ``ReplicaDivergenceError``); with ``parameters`` (the end of a run), the components 0 of
        parameters whose primary lives elsewhere hand their value to the primary; without (an optimizer
        step's merge), this step's slice is compared too. Marks what changed for the next seed."""
        if not parameters:
            self.check_slice()
            self.steps += 1
        owned = self.views.owned_components()
        if not parameters:
            owned = [(t, comps) for t, comps in owned if not isinstance(t, torch.nn.Parameter)]
        if not owned:
            return
        means = [(t, comps) for t, comps in owned if len(comps) > 1 and self._averaged(t)]
        averaged = {}
        if means:
            pairs: Pairs = [(PerReplica(tuple(comps)), (t.device,)) for t, comps in means]
            reduced = self._ops.batch_reduce_implementation(ReduceOp.MEAN, pairs, None)
            averaged = {id(t): v for (t, _), v in zip(means, reduced)}
        agreement.check_replicas([(t, comps) for t, comps in owned if id(t) not in averaged],
                                 f"optimizer step {self.steps}", self.name_of, _written_cause)
        written = []
        with torch.no_grad():
            for t, comps in owned:
                value = averaged.get(id(t), comps[0])
                if value is not t:
                    t.copy_(value)  # (the next seed copies it into every component)
                    written.append(t)
        self.views.mark(written)

    def _averaged(self, t: torch.Tensor) -> bool:
        """A buffer declared MEAN (never a parameter: parameters are ON_WRITE)."""
        return not isinstance(t, torch.nn.Parameter) and id(t) in self._mean_ids

    def name_of(self, t: torch.Tensor) -> str:
        """``t``'s name in the modules made in the scope ("0.weight", "bn.running_mean"), else its shape."""
        for m in (r() for r in self._modules):
            if m is None:
                continue
            for name, x in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]:
                if x is t:
                    return f"{type(m).__name__}.{name}"
        return f"a tensor of shape {tuple(t.shape)}"

    def mark_written(self, tensors: list[torch.Tensor]) -> None:
        """Tells the next seed that cross-replica code wrote ``tensors`` (an optimizer step)."""
        self.views.mark(tensors)

    def components(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The tensors replica 0..N-1 computes with for ``t`` (``t`` itself where that is the primary)."""
        return list(self.views.components(t))


_WRITE_FIX = (
    "Write it from values that are the same on every replica (gradients after backward() are the cross-replica "
    "sum; reduce or gather other values with ts.get_replica_context().all_reduce / all_gather), or write it in a "
    "merge_call (ts.get_replica_context().merge_call(fn)), which runs once in cross-replica context")
_DECLARE = (", or, if the replicas' copies should be averaged (a running statistic), declare it: "
            "ts.declare_buffer_aggregation(module, name, 'mean')")


def _declare(t: torch.Tensor) -> str:
    floating_buffer = not isinstance(t, torch.nn.Parameter) and (t.is_floating_point() or t.is_complex())
    return _DECLARE if floating_buffer else ""


def _written_cause(t: torch.Tensor) -> str:
    return ("the replicas wrote different values to it inside strategy.run (in place, or `p.data = ...` in some "
            f"replicas). {_WRITE_FIX}{_declare(t)}")


def _uncounted_cause(t: torch.Tensor) -> str:
    return ("a write inside strategy.run that torch does not count (through `p.data`, or a kernel that bypasses "
            f"the version counter) left the replicas' copies different. {_WRITE_FIX}{_declare(t)}")
