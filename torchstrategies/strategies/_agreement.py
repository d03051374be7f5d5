"""MultiWorkerMirroredStrategy's use of the agreement seam (``distribute/agreement.py``): what its ranks must
hold equal, what to call it in an error, and what likely made it differ.

At every ``optimizer.step()`` :meth:`WorkerAgreement.before_step` (the strategy's step pre-hook, after the
gradients are reduced and the MEAN buffers averaged, before the update) runs the check of
``distribute/agreement_step.py`` (what moved and what is forced, whole, and this step's piece of the
rotating slice: one C++ call and one all-reduce) and :meth:`WorkerAgreement.after_step` (the step
post-hook) records the optimizer's own writes: over the parameters and the
buffers not declared MEAN of the modules made in the scope, and the parameters of the stepping optimizer
(tracked); the parameters of an optimizer no strategy watches, whole (forced: a model and optimizer made
outside the scope, trained apart on every rank).
:meth:`WorkerAgreement.held` walks the modules once a step, for this check and for the MEAN buffers'
averaging. :meth:`WorkerAgreement.check_all` compares every parameter (a checkpoint save,
``extended.check_divergence()``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from torchstrategies.collectives import debug as collective_debug
from torchstrategies.distribute import agreement
from torchstrategies.distribute.agreement import RankAgreement
from torchstrategies.distribute.agreement_step import AGREEMENT_SLICES, StepAgreement, StepTensors
from torchstrategies.distribute.buffers import is_mean_buffer, modules_of
from torchstrategies.reduce_op import ReduceOp

__all__ = ["WorkerAgreement", "Held", "steps_with"]

_UNWATCHED = (
    "the optimizer stepping it was made outside strategy.scope() over a model made outside it, so no rank's "
    "gradients reach the others and each rank trains a model of its own (a different seed per rank starts them "
    "apart). Make the model and the optimizer inside `with strategy.scope():` (or the optimizer alone: its "
    "parameters are then broadcast from rank 0 and their gradients summed)")
_MOVED = (
    "it was written in place outside the optimizer (its version counter moved) with values that differ between "
    "the ranks: a write from per-rank values (a per-rank loss, batch or random draw) or on some ranks only. "
    "Write it from values that are the same on every rank (gradients after backward() are the global sum; "
    "all-reduce other values with ts.get_replica_context().all_reduce)")
_UNCOUNTED = (
    "a write torch does not count (`p.data = ...`, a write through `p.data`, a kernel that bypasses the version "
    "counter) with values that differ between the ranks, or an optimizer's update that came out differently on "
    "some rank (ranks that step different optimizers, or an optimizer whose learning rate or state differs "
    "between the ranks). Write it from values that are the same on every rank, in place under torch.no_grad() "
    "(then it is checked at the next step), and step the same optimizers, set alike, on every rank")
_RENORM = (
    "nn.Embedding(max_norm=...) renormalizes, in forward, the rows that this rank's batch looked up, so each "
    "rank renormalizes different rows. Drop max_norm, or renormalize the whole weight after optimizer.step(), "
    "the same on every rank (with torch.no_grad(): emb.weight.copy_(torch.renorm(emb.weight, 2, 0, max_norm)))")
_DECLARE = (" If the ranks' copies of this buffer should be averaged (a running statistic), declare it: "
            "ts.declare_buffer_aggregation(module, name, 'mean')")


@dataclass
class Held:
    """What the ranks hold of the modules a step of one optimizer concerns (one walk,
    :meth:`WorkerAgreement.held`): ``tracked``, their parameters and the buffers not declared MEAN, then the
    optimizer's other parameters (compared); ``mean``, their buffers declared MEAN (averaged at the step)."""

    tracked: list[torch.Tensor]
    mean: list[torch.Tensor]


class WorkerAgreement:
    """The agreement of one MultiWorkerMirroredStrategy's ranks.

    Args:
        all_reduce: ``fn(op, tensors) -> tensors`` reduced over the strategy's process group, at once, in place
            (``extended.all_reduce_in_place``: the check's one all-reduce runs in the caller's thread; on the
            strategy's backend a started collective would run on the backend's thread, which costs a step more
            on a busy CPU).
        rank, world, device: this rank, the group's size, the rank's device.
        modules: the modules made in the scope (weak references, in creation order).
    """

    def __init__(self, all_reduce: Callable[[ReduceOp, list[torch.Tensor]], list[torch.Tensor]], rank: int, world: int,
                 device: torch.device, modules: list[weakref.ref[torch.nn.Module]]) -> None:
        self.ranks = RankAgreement(all_reduce, rank, world, device)
        slices = 0 if not agreement.enabled() else 1 if collective_debug.enabled() else AGREEMENT_SLICES
        self.step = StepAgreement(self.ranks, slices)
        self._modules = modules
        self._stepping: weakref.ref[torch.optim.Optimizer] | None = None
        # Per optimizer, what its steps compare (kept while the list is the same) and its turn through the
        # rotating slice's pieces of its tensors.
        self._lists: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepTensors] = weakref.WeakKeyDictionary()

    # --- what the modules hold ------------------------------------------------------------------------------
    def _walk(self, optimizer: torch.optim.Optimizer | None = None
              ) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
        """(owner, name in owner, tensor, is a MEAN buffer) for every parameter and buffer of the modules made in
        the scope, each tensor once, in the same order on every rank; with ``optimizer``, of those it trains
        (:func:`steps_with`)."""
        seen: set[int] = set()
        stepped = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        for root in (r() for r in self._modules):
            if root is not None and stepped is not None and not steps_with(root, stepped):
                continue
            for m in () if root is None else modules_of(root):
                for name, p in m._parameters.items():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        yield m, name, p, False
                for name, b in m._buffers.items():
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        yield m, name, b, is_mean_buffer(m, name)

    def held(self, optimizer: torch.optim.Optimizer) -> Held:
        """The tensors a step of ``optimizer`` concerns, in the same order on every rank (one walk)."""
        tracked: list[torch.Tensor] = []
        mean: list[torch.Tensor] = []
        for _, _, t, is_mean in self._walk(optimizer):
            (mean if is_mean else tracked).append(t)
        ids = {id(t) for t in tracked}
        tracked += [p for p in dict.fromkeys(p for g in optimizer.param_groups for p in g["params"])
                    if id(p) not in ids]
        return Held(tracked, mean)

    def mean_buffers(self, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
        return [t for _, _, t, mean in self._walk(optimizer) if mean]

    def describe(self, t: torch.Tensor) -> tuple[str, torch.nn.Module | None]:
        """``t``'s name ("Sequential.1.bias") and owning module, else a description of its shape."""
        for root in (r() for r in self._modules):
            if root is None:
                continue
            for path, m in root.named_modules(remove_duplicate=False):
                for name, x in [*m._parameters.items(), *m._buffers.items()]:
                    if x is t:
                        return f"{type(root).__name__}.{path + '.' if path else ''}{name}", m
        return f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}", None

    def cause(self, t: torch.Tensor, reason: str) -> str:
        _, owner = self.describe(t)
        if reason == "unwatched":
            return _UNWATCHED
        if isinstance(owner, torch.nn.Embedding) and owner.max_norm is not None and t is owner.weight:
            return _RENORM
        text = _MOVED if reason == "moved" else _UNCOUNTED
        if not isinstance(t, torch.nn.Parameter) and (t.is_floating_point() or t.is_complex()):
            text += _DECLARE
        return text

    # --- the checks -----------------------------------------------------------------------------------------
    def before_step(self, optimizer: torch.optim.Optimizer, held: Held | None) -> None:
        """The step pre-hook: the check of this step, before its update; it raises, on every rank, if the ranks
        differ (``held``: what the step concerns, None when no parameter of ``optimizer`` is the strategy's:
        its parameters are then compared whole)."""
        if not self.step.slices:   # the check is off (TORCHSTRATEGIES_AGREEMENT=0): nothing to keep either
            self._stepping = None
            return
        if held is None:
            self._stepping = None
            tracked: list[torch.Tensor] = []
            forced = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        else:
            self._stepping = weakref.ref(optimizer)
            tracked, forced = held.tracked, []
        lists = self._lists.get(optimizer)
        if lists is None:
            lists = self._lists[optimizer] = StepTensors()
        lists.use(tracked, forced)
        outside = held is None

        def raise_for(i: int, reason: str, fingerprint: int, when: str) -> None:
            t = lists.tensors[i]
            name = self._outside_name(optimizer, t) if outside else self.describe(t)[0]
            self.ranks.raise_for([(name, t)], when, lambda _: self.cause(t, reason), fingerprint)

        self.step.check(lists, raise_for)

    @staticmethod
    def _outside_name(optimizer: torch.optim.Optimizer, t: torch.Tensor) -> str:
        for gi, g in enumerate(optimizer.param_groups):
            for pi, p in enumerate(g["params"]):
                if p is t:
                    return (f"{type(optimizer).__name__}.param_groups[{gi}]['params'][{pi}] (shape "
                            f"{tuple(p.shape)}, made outside the scope)")
        return f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step post-hook: the optimizer's own writes are not news at the next step, whose check takes the
        next piece of the rotating slice."""
        if self._stepping is not None and self._stepping() is optimizer:
            lists = self._lists.get(optimizer)
            if lists is not None:
                self.step.record(lists)
        self._stepping = None

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The check of a step of ``optimizer`` (the fault-tolerant mode's commit point, where the check
        belongs to the step's transaction: :meth:`before_step` over what the step concerns)."""
        self.before_step(optimizer, self.held(optimizer))

    def check_all(self, when: str) -> None:
        """Every parameter of the modules made in the scope, whole (every rank calls it)."""
        params = [t for _, _, t, _ in self._walk() if isinstance(t, torch.nn.Parameter)]
        bad = self.ranks.differing(params)
        if bad:
            t = params[bad[0]]
            self.ranks.raise_for([(self.describe(t)[0], t)], when, lambda t: self.cause(t, "slice"))


def steps_with(module: torch.nn.Module, stepped: set[int]) -> bool:
    """Whether a step of the optimizer over ``stepped`` (ids of its live parameters) concerns ``module``'s
    tensors: it has one of them, or no trainable parameter at all (a teacher, a parameterless normalization).
    Not a module trained by another optimizer: so the set is the same on every rank whatever the garbage
    collector has freed (a model of an earlier fold or sweep trial, kept alive by a reference cycle on one
    rank only, is not in it)."""
    trainable = False
    for m in modules_of(module):
        for p in m._parameters.values():
            if p is not None:
                if id(p) in stepped:
                    return True
                trainable = trainable or p.requires_grad
    return not trainable
