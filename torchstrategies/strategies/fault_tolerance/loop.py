"""``TransactionalLoop``: the training step of a fault-tolerant job, as a transaction.

One :meth:`TransactionalLoop.step`:

1. If this worker has no group (start, after a fault, or when workers wait to join), it forms the next
   generation (``membership.py``), makes the generation's group and, if a member lacks the live state,
   copies it from a member that has it (``state_transfer.py``).
2. It snapshots what the forward may change (the model's buffers, the torch random state), runs
   ``loss_fn`` on its part of global batch ``steps`` (``global_batches.py``) and ``backward()``.
3. The gradients (which backward wrote into one flat buffer per dtype), one "had a gradient" flag per
   parameter, the buffers weighted by this member's share of the rows, and the loss are summed over the
   group in ONE all-reduce per dtype.
4. The step's decision (``Membership.commit``): committed only if that all-reduce completed on every
   member. Committed: the gradients are written back, the optimizer and the scheduler step, ``steps``
   grows by one. Discarded: buffers and random state are restored, nothing else was touched; the worker
   forms the next generation and runs the same global batch again, split among the survivors.

The sum over the members is the sum over the global batch's rows in another grouping, so a run that lost
and regained workers ends at the uninterrupted run's parameters up to float rounding of that sum.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.distribute.buffers import is_mean_buffer
from torchstrategies.errors import CancelledError, MembershipBelowMinimumError, UnavailableError
from torchstrategies.strategies.fault_tolerance.global_batches import GlobalBatches
from torchstrategies.strategies.fault_tolerance.membership import Generation, Membership, Refused
from torchstrategies.strategies.fault_tolerance.state_transfer import broadcast_state

__all__ = ["TransactionalLoop", "make_group"]

log = logging.getLogger("torchstrategies.multi_worker")

Group = Any  # a c10d ProcessGroupGloo or our backend: both have allreduce / broadcast returning a Work


def make_group(store: dist.Store, gen: Generation, timeout: float, implementation: CommunicationImplementation
               ) -> Group:
    """The generation's group, over its own key prefix (a collective of the generation's members)."""
    prefixed = dist.PrefixStore(f"g{gen.number}/pg/", store)
    if implementation is CommunicationImplementation.GLOO:
        return dist.ProcessGroupGloo(prefixed, gen.index, gen.size, datetime.timedelta(seconds=timeout))
    from torchstrategies.collectives import backend

    impl = backend._implementation(implementation.name)
    return backend.make(prefixed, gen.index, gen.size, timeout, list(range(gen.size)),
                        f"fault-tolerant generation {gen.number}", impl)


class _Flat:
    """One dtype's part of the step's all-reduce: the gradients (the parameters' ``.grad`` are views into
    it during backward), then the float buffers of that dtype, then (in the first) flags and the loss."""

    def __init__(self, params: list[torch.nn.Parameter], buffers: list[torch.Tensor], extra: int) -> None:
        p0 = (params or buffers)[0]
        self.params, self.buffers = params, buffers
        sizes = [t.numel() for t in params] + [b.numel() for b in buffers]
        self.flat = torch.zeros(sum(sizes) + extra, dtype=p0.dtype, device=p0.device)
        self.views, off = [], 0
        for t, n in zip(list(params) + list(buffers), sizes):
            self.views.append(self.flat[off:off + n].view_as(t))
            off += n
        self.extra = self.flat[off:]


class TransactionalLoop:
    """Runs training steps that every live worker applies or none does (see the module docstring).

    Made by ``FaultTolerantMultiWorkerMirroredStrategy.training_loop``; every worker makes one with the same
    model, optimizer, scheduler and data.

    Attributes:
        steps: steps committed (also the data position: the next global batch).
        generation: the current generation (None between generations).
        aborted, refused, healed_at: steps discarded here, times this worker was refused, and the ``steps``
            at which it received the live state (None: it never did).
        phase_hook: called with the phase name ("forward", "all_reduce", "commit", "apply", "heal_send"
            (the heal's source), "heal" (the others), "heal_header"); for fault-injection tests.
    """

    def __init__(self, membership: Membership, min_workers: int, timeout: float,
                 implementation: CommunicationImplementation, device: torch.device, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, data: GlobalBatches, scheduler: Any = None) -> None:
        self._membership, self._min, self._timeout = membership, min_workers, timeout
        self._implementation, self._device = implementation, device
        self.model, self.optimizer, self.data, self.scheduler = model, optimizer, data, scheduler
        self.steps = 0
        self.generation: Generation | None = None
        self.group: Group | None = None
        self._stateful = False
        self._previous: Generation | None = None
        self.aborted = 0
        self.refused = 0
        self.healed_at: int | None = None
        self.phase_hook: Callable[[str], None] | None = None
        self._flats: list[_Flat] = []
        self._layout: list[tuple[torch.nn.Parameter, torch.dtype, torch.Size]] = []
        self._had = torch.zeros(0)
        self._hooks: list[Any] = []

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    # --- membership -----------------------------------------------------------------------------------------
    def _join(self) -> None:
        """Forms generations until this worker is a member of one with a group and the live state."""
        while True:
            previous = self._previous if self._previous is not None else self._membership.latest()
            number = (previous.number if previous is not None else 0) + 1
            try:
                gen = self._membership.form(number, previous, self.steps if self._stateful else -1)
            except Refused:
                self.refused += 1
                self._stateful = False  # its generation is old: it comes back as a new member
                self._previous = None
                continue
            self._previous = gen
            if gen.size < self._min:
                raise MembershipBelowMinimumError(
                    f"fault-tolerant MultiWorkerMirrored: generation {gen.number} has {gen.size} live worker(s) "
                    f"{list(gen.members)}, below FaultTolerance.min_workers={self._min}; the job stops")
            try:
                self.group = make_group(self._membership.store, gen, self._timeout, self._implementation)
                self._heal(gen)
            except (UnavailableError, CancelledError):
                raise
            except RuntimeError as exc:  # a member was lost while forming: the next generation
                log.warning("generation %d could not start (%s); forming the next", gen.number, exc)
                self.group = None
                continue
            self.generation = gen
            self._membership.begin(gen, self.steps)
            log.info("generation %d: %d member(s), this worker is %d, at step %d", gen.number, gen.size,
                     gen.index, self.steps)
            return

    def _heal(self, gen: Generation) -> None:
        most = max(gen.steps)
        if most >= 0 and all(s == most for s in gen.steps):
            return
        if most < 0 and self._membership.state_existed():
            finished = self._membership.finished()
            if finished is not None:
                raise CancelledError(f"fault-tolerant MultiWorkerMirrored: the job finished at step {finished} "
                                     "before this worker could rejoin it; there is nothing left to do")
            raise UnavailableError(
                f"fault-tolerant MultiWorkerMirrored: generation {gen.number} ({list(gen.members)}) has no member "
                "holding the job's state: every worker that held it is gone (or the job finished). Restart the "
                "job from its last checkpoint")
        src = gen.steps.index(most) if most >= 0 else 0
        receives = gen.index != src and (most < 0 or gen.steps[gen.index] != most)
        self._phase("heal_send" if gen.index == src else "heal")
        assert self.group is not None
        state = broadcast_state(self.group, src, self._live_state, self._device, self._phase)
        if receives:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"].cpu())
            if self._device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"].cpu(), self._device)
            self.healed_at = int(state["steps"])
        self.steps = int(state["steps"])
        self._stateful = True
        if most < 0:
            self._membership.mark_state_exists()

    def _live_state(self) -> dict[str, object]:
        return {"steps": self.steps, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None}

    def _leave_group(self) -> None:
        self._membership.end()
        self.group = None
        self.generation = None

    # --- the step ---------------------------------------------------------------------------------------------
    def _flats_for_step(self) -> list[_Flat]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        layout = [(p, p.dtype, p.shape) for p in params]
        if len(layout) != len(self._layout) or any(a[0] is not b[0] or a[1:] != b[1:]
                                                    for a, b in zip(layout, self._layout)):
            self._layout = layout
            buffers = [b for m in self.model.modules() for name, b in m._buffers.items()
                       if b is not None and b.is_floating_point() and is_mean_buffer(m, name)]
            dtypes = list(dict.fromkeys([p.dtype for p in params] + [b.dtype for b in buffers]))
            self._flats = [_Flat([p for p in params if p.dtype == d], [b for b in buffers if b.dtype == d],
                                 len(params) + 1 if i == 0 else 0) for i, d in enumerate(dtypes)]
            self._had = torch.zeros(len(params))
            for h in self._hooks:
                h.remove()
            self._hooks = [p.register_post_accumulate_grad_hook(self._marker(i)) for i, p in enumerate(params)]
        return self._flats

    def _marker(self, i: int) -> Callable[[torch.Tensor], None]:
        def mark(_: torch.Tensor) -> None:
            self._had[i] = 1.0
        return mark

    def step(self, loss_fn: Callable[[Any], torch.Tensor]) -> float:
        """Runs global batch ``steps`` until it is committed; returns its loss (summed over the members).

        Args:
            loss_fn: ``loss_fn(local_batch) -> loss`` over this worker's rows, divided by the GLOBAL batch
                size (``ts.compute_average_loss(..., global_batch_size=B)``); the loop calls ``backward``.

        Raises:
            MembershipBelowMinimumError: fewer live workers than ``min_workers``.
            CancelledError: this worker came back after the job finished (a member's ``shutdown()``).
            UnavailableError: no live worker holds the job's state any more.
        """
        while True:
            if self.group is None:
                self._join()
            gen = self.generation
            assert gen is not None and self.group is not None
            flats = self._flats_for_step()
            buffers = list(self.model.buffers())
            saved = [b.clone() for b in buffers]
            rng = torch.get_rng_state()
            batch = self.data.local_batch(self.steps, gen.index, gen.size)
            share = len(self.data.local_indices(self.steps, gen.index, gen.size)) / self.data.global_batch_size
            for f in flats:
                f.flat.zero_()
                for p, v in zip(f.params, f.views):
                    p.grad = v
            self._had.zero_()
            try:
                self._phase("forward")
                loss = loss_fn(batch)
                loss.backward()
            except BaseException:
                self._restore(buffers, saved, rng)
                self._membership.commit(gen, self.steps, False)  # the others redo this step without us
                self._leave_group()
                raise
            ok = self._all_reduce(flats, loss, share)
            committed, joiners = self._membership.commit(gen, self.steps, ok)
            if committed:
                self._phase("apply")
                total = self._apply(flats)
                self.steps += 1
                if joiners:
                    self._leave_group()  # workers wait to join: the next step forms a generation with them
                return total
            self.aborted += 1
            self._restore(buffers, saved, rng)
            for f in flats:
                for p in f.params:
                    p.grad = None
            log.warning("step %d discarded in generation %d; forming the next generation", self.steps, gen.number)
            self._leave_group()

    def _all_reduce(self, flats: list[_Flat], loss: torch.Tensor, share: float) -> bool:
        with torch.no_grad():
            for f in flats:
                for p, v in zip(f.params, f.views):
                    if p.grad is not None and p.grad.data_ptr() != v.data_ptr():
                        v.copy_(p.grad)  # autograd replaced the view (e.g. a gradient of another layout)
                for b, v in zip(f.buffers, f.views[len(f.params):]):
                    v.copy_(b).mul_(share)
            extra = flats[0].extra
            n = len(self._had)
            extra[:n].copy_(self._had)
            extra[n].copy_(loss.detach())
        self._phase("all_reduce")
        try:
            assert self.group is not None
            for f in flats:
                self.group.allreduce([f.flat]).wait()
        except RuntimeError as exc:
            log.warning("step %d: all-reduce failed in generation %s: %s", self.steps,
                        None if self.generation is None else self.generation.number, exc)
            return False
        self._phase("commit")
        return True

    def _apply(self, flats: list[_Flat]) -> float:
        extra = flats[0].extra
        n = len(self._had)
        had = extra[:n].tolist()
        i = 0
        with torch.no_grad():
            for f in flats:
                for p, v in zip(f.params, f.views):
                    p.grad = v if had[i] > 0.5 else None
                    i += 1
                for b, v in zip(f.buffers, f.views[len(f.params):]):
                    b.copy_(v)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(extra[n].item())

    @staticmethod
    def _restore(buffers: list[torch.Tensor], saved: list[torch.Tensor], rng: torch.Tensor) -> None:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
        torch.set_rng_state(rng)

    def close(self) -> None:
        if self.generation is not None:  # a member in good standing ends the job's training here
            self._membership.mark_finished(self.steps)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._leave_group()
