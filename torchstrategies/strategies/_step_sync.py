"""What MultiWorkerMirroredStrategy does at ``optimizer.step()``: the optimizer applies the cross-worker sum
of every gradient it is about to apply, however it was made, and never sums one twice.

A gradient a synchronized backward reduced is *proven* (``GradientSynchronizer.proven``: ``p.grad`` is still
the reduced bucket view, in-place changes such as clipping allowed) and costs nothing here. Every other
gradient of the optimizer's parameters is reduced at the step, in the optimizer's parameter order, through
the same bucket machinery (flags for missing gradients, sparse gradients gathered): a gradient assigned to
``p.grad`` (DP-SGD, ``torch.func``), one of a parameter made trainable after the scope, one whose parameter
changed dtype or device. Afterwards it is its synchronizer's reduced gradient (so a later backward adds to
it once, and the next step does not reduce it again). A parameter no synchronizer watches (added to the
optimizer later) gets a synchronizer of its own here, so its next backward is synchronized.

Which gradients are reduced here must be the same on every rank: the same code on every rank does that
(assigning a gradient on some ranks only leaves the others waiting, and the collective's timeout names it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch

from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies._grad_sync import GradientSynchronizer, Hook

__all__ = ["Synchronizers", "average_mean_buffers"]

Owners = list[tuple[torch.nn.Parameter, GradientSynchronizer | None]]


@dataclasses.dataclass(frozen=True)
class OptimizerLookup:
    """Which synchronizers watch an optimizer's parameters (``Synchronizers.for_optimizer``), valid while the
    strategy's synchronizers (``generation``) and the optimizer's parameters are the same."""

    generation: int  # the Synchronizers' generation it was made in
    syncs: list[GradientSynchronizer]  # those that watch some of the optimizer's parameters, in creation order
    owners: Owners  # each parameter (first occurrence, group order) with the synchronizer watching it, or None

    def valid(self, generation: int, params: list[torch.nn.Parameter]) -> bool:
        return (self.generation == generation and len(self.owners) == len(params)
                and all(a is b for (a, _), b in zip(self.owners, params)))


class Synchronizers:
    """A strategy's gradient synchronizers, in creation order (the order their collectives start in before a
    step); one whose parameters are all gone is forgotten. :meth:`before_step` is the optimizer pre-hook.

    Args:
        make: ``make(params, autograd_hooks)`` -> a ``GradientSynchronizer`` on the strategy's group.
    """

    def __init__(self, make: Callable[[list[torch.nn.Parameter], bool], GradientSynchronizer]) -> None:
        self._make = make
        self._list: list[GradientSynchronizer] = []
        self._generation = 0  # bumped on every change, so an optimizer's cached lookup is redone
        # Held by the strategy, keyed weakly by the optimizer (nothing is written on the user's object).
        self._lookups: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerLookup] = (
            weakref.WeakKeyDictionary())

    def add(self, sync: GradientSynchronizer) -> None:
        self._list = self.live() + [sync]
        self._generation += 1

    def live(self) -> list[GradientSynchronizer]:
        live = [s for s in self._list if s.alive]
        if len(live) != len(self._list):
            self._list = live
            self._generation += 1
        return live

    def for_optimizer(self, optimizer: torch.optim.Optimizer) -> tuple[list[GradientSynchronizer], Owners]:
        """The synchronizers that watch some of ``optimizer``'s parameters, and each parameter with its
        synchronizer (None: none watches it); remembered for the optimizer until either changes."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        known = self._lookups.get(optimizer)
        if known is not None and known.valid(self._generation, params):
            return known.syncs, known.owners
        live = self.live()
        owners = []
        seen: set[int] = set()
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                owners.append((p, next((s for s in live if s.owns(p)), None)))
        found = [s for s in live if any(o is s for _, o in owners)]
        self._lookups[optimizer] = OptimizerLookup(self._generation, found, owners)
        return found, owners

    def before_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Finishes the reductions in flight (and what ``no_sync`` left pending), then reduces every gradient
        the step would apply that no backward reduced (see the module docstring).

        Returns:
            Whether ``optimizer`` has parameters of this strategy (False: nothing was done).
        """
        syncs, owners = self.for_optimizer(optimizer)
        if not syncs:
            return False
        for s in syncs:
            s.before_step()
        unproven = [(p, o) for p, o in owners if _needs_reduction(p, o)]
        if not unproven:
            return True
        params = [p for p, _ in unproven]
        self._make(params, False).reduce_now()  # the optimizer's order: the same on every rank
        for s in syncs:
            s.take_reduced([p for p, o in unproven if o is s])
        strays = [p for p, o in unproven if o is None]
        if strays:
            sync = self._make(strays, True)
            sync.take_reduced(strays)
            self.add(sync)
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for s in self.live():
                stack.enter_context(s.no_sync())
            yield

    def set_hook(self, hook: Hook) -> None:
        for s in self.live():
            s.set_hook(hook)

    def close(self) -> None:
        for s in self.live():
            s.close()


def _needs_reduction(p: torch.nn.Parameter, owner: GradientSynchronizer | None) -> bool:
    if owner is None or not owner.synchronizes(p):  # (trainable or not: the same on every rank)
        return p.requires_grad or p.grad is not None
    return p.grad is not None and not owner.proven(p)


def average_mean_buffers(buffers: list[torch.Tensor],
                         all_reduce: Callable[[ReduceOp, list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """The buffers declared MEAN (``distribute/buffers.py``) become their mean over the ranks (one all-reduce).
    Every other buffer is the agreement check's (``_agreement.py``): it must be equal on every rank."""
    if not buffers:
        return
    reduced = all_reduce(ReduceOp.MEAN, buffers)
    with torch.no_grad():
        for b, v in zip(buffers, reduced):
            b.copy_(v)
