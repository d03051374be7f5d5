"""``TransactionalLoop``: the training step of a fault-tolerant job, as a transaction around the user's own
step code.

One :meth:`TransactionalLoop.step` (``step_fn(batch)``: forward, ``loss.backward()``, any clipping,
``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``, as under every strategy):

1. If this worker has no group (start, after a fault, or when workers wait to join), it forms the next
   generation (``membership.py``), makes the generation's group and, if a member lacks the live state,
   copies it from a member that has it (``state_transfer.py``).
2. It snapshots what ``step_fn`` may change before its commit point (the model's buffers and the random
   states, ``snapshot.py``) and calls ``step_fn`` on its part of global batch ``steps`` (``global_batches.py``)
   with no ``.grad``; each gradient backward makes is copied by its parameter's hook into one flat buffer per
   dtype (``.grad`` becomes a view into it), as MultiWorkerMirrored's synchronizer does.
3. **The commit point is the end of ``loss.backward()``** (a callback the first gradient hook queues in the
   autograd engine, as DDP's reducer does): there the gradients, one "had a gradient" flag per parameter,
   the joiners this member saw and the MEAN buffers weighted by this member's share of the rows are summed
   over the group in ONE all-reduce per dtype, and the per-step agreement check runs (the MultiWorkerMirrored
   one, ``strategies/_agreement.py``, over the generation's group). **A member applies the step when every
   collective of it completed on that member**: no store round trip, no vote. Applied: ``.grad`` holds the
   global gradient and the buffers their global value when ``backward()`` returns; what ``step_fn`` does next
   (clipping, the optimizer, the scheduler, a GradScaler) runs as under MultiWorkerMirrored and the step
   counts once; if the summed joiners are not zero, every member leaves the group after the step (they all
   read the same sum). Discarded (a collective of the step failed on this member, or before the commit
   point: a collective ``step_fn`` asked for failed): an internal exception unwinds ``step_fn`` out of
   ``backward()`` before anything was applied; the buffers and random states are restored, the member tears
   the group down (its peers' collectives over it fail at once: ``group.py``), forms the next generation and
   calls ``step_fn`` again on the same global batch split among the survivors.

A collective can complete on some members and fail on others (a member lost after it sent its last part):
those members apply the step, fail their next one (the group is torn down) and register for the next
generation with one step more than the others; the generation copies the state of a member with the most
steps to the others (``_heal``). A step one member applied was an all-reduce over every member of the
generation, so applied on some members and discarded on others, it ends applied once on every member of the
next generation: nothing is applied twice or lost (``membership.py``).

After the commit point a collective cannot be part of the step (a lost member would leave some members with
its result and others without): ``strategy.reduce`` there raises ``CollectiveAfterCommitError`` on every
member, before anything is sent. The sum over the members is the sum over the global batch's rows in another
grouping, so a run that lost and regained workers ends at the uninterrupted run's parameters up to float
rounding of that sum.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.distribute.buffers import is_mean_buffer
from torchstrategies.distribute.replica_share import linear_gradient_hook
from torchstrategies.errors import (
    CancelledError,
    CollectiveAfterCommitError,
    MembershipBelowMinimumError,
    ReplicaDivergenceError,
    UnavailableError,
)
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies._agreement import WorkerAgreement
from torchstrategies.strategies.fault_tolerance import random_states
from torchstrategies.strategies.fault_tolerance.global_batches import GlobalBatches
from torchstrategies.strategies.fault_tolerance.group import (
    CollectiveFailed,
    Flat,
    Group,
)
from torchstrategies.strategies.fault_tolerance.membership import Generation, Membership, Refused
from torchstrategies.strategies.fault_tolerance.snapshot import StepSnapshot
from torchstrategies.strategies.fault_tolerance.state_transfer import broadcast_state

__all__ = ["TransactionalLoop", "StepAborted"]

log = logging.getLogger("torchstrategies.multi_worker")


class StepAborted(BaseException):
    """The step in flight was discarded on this member (one of its collectives failed).

    Internal: raised inside ``step_fn`` (out of ``loss.backward()`` or a collective) to unwind it before
    anything is applied; :meth:`TransactionalLoop.step` catches it and redoes the step. A ``BaseException``,
    so that an ``except Exception`` in ``step_fn`` does not swallow it."""


class _Phase(enum.Enum):
    IDLE = "outside a step"
    OPEN = "before the commit point"
    COMMITTING = "at the commit point"
    COMMITTED = "after the commit point"


class TransactionalLoop:
    """Runs the user's training steps so that every live worker applies each one or none does (see the module
    docstring).

    Made by ``FaultTolerantMultiWorkerMirroredStrategy.training_loop``; every worker makes one with the same
    model, optimizer, scheduler and data.

    Attributes:
        steps: steps committed (also the data position: the next global batch).
        generation: the current generation (None between generations).
        aborted, refused, healed_at: steps discarded here, times this worker was refused, and the ``steps``
            at which it received the live state (None: it never did).
        phase_hook: called with the phase name ("forward", "all_reduce", "commit" (every collective of
            the step completed on this member; a ``CollectiveFailed`` raised there counts as one that failed
            on it alone), "apply", "heal_send" (the heal's source), "heal" (the others), "heal_header");
            for fault-injection tests.
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
        self._flats: list[Flat] = []
        self._layout: list[tuple[torch.nn.Parameter, torch.dtype, torch.Size]] = []
        self._had: list[bool] = []     # per trainable parameter: backward gave it a gradient in this attempt
        self._snapshot = StepSnapshot(model, device)
        self._hooks: list[Any] = []
        self._phase_of_step = _Phase.IDLE
        self._joiners = 0            # registrations for the next generation, summed over the members
        self._share = 0.0            # this member's rows / the global batch's
        self._stepped = False        # the optimizer stepped in this step
        self._agreement: WorkerAgreement | None = None
        self._optimizer_hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                                 optimizer.register_step_post_hook(self._after_optimizer_step)]

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
                self.group = Group(self._membership.store, gen, self._timeout, self._implementation)
                self._heal(gen)
            except (CollectiveFailed, RuntimeError) as exc:
                self._close_group(abort=True)
                if isinstance(exc, (UnavailableError, CancelledError)):
                    raise
                log.warning("generation %d could not start (%s); forming the next", gen.number, exc)
                continue  # a member was lost while forming: the next generation
            self.generation = gen
            self._agreement = None if gen.size == 1 else WorkerAgreement(
                self._group_all_reduce, gen.index, gen.size, self._device, [weakref.ref(self.model)])
            self._membership.begin(gen)
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
            random_states.restore(state["random"], self._device)
            self.healed_at = int(state["steps"])
        self.steps = int(state["steps"])
        self._stateful = True
        if most < 0:
            self._membership.mark_state_exists()

    def _live_state(self) -> dict[str, object]:
        return {"steps": self.steps, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "random": random_states.capture(self._device)}

    def _group_all_reduce(self, op: ReduceOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The agreement check's collective: over the generation's group (``CollectiveFailed`` on failure)."""
        assert self.group is not None
        self.group.all_reduce(op, tensors)
        return tensors

    def _close_group(self, abort: bool) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close(abort)

    def _leave_group(self, abort: bool) -> None:
        """Leaves the generation; ``abort``: in the middle of a step, so the peers' collectives fail at once."""
        self._membership.end()
        self._close_group(abort)
        self.generation = None
        self._agreement = None

    # --- the step ---------------------------------------------------------------------------------------------
    def step(self, step_fn: Callable[[Any], Any]) -> Any:
        """Runs ``step_fn`` on this worker's part of global batch ``steps`` until the step is committed.

        Args:
            step_fn: ``step_fn(local_batch)``: the ordinary step code over this worker's rows: the loss
                divided by the GLOBAL batch size (``ts.compute_average_loss(..., global_batch_size=B)``),
                ``loss.backward()`` once (after which ``.grad`` is the global gradient), then clipping,
                ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()`` as on one device. It
                may run more than once for one step (redone after a discarded attempt): what it changes
                before ``backward()`` returns, other than the model's buffers and the random states, is not
                rolled back.

        Returns:
            What ``step_fn`` returned in the committed attempt.

        Raises:
            MembershipBelowMinimumError: fewer live workers than ``min_workers``.
            CancelledError: this worker came back after the job finished (a member's ``shutdown()``).
            UnavailableError: no live worker holds the job's state any more.
            CollectiveAfterCommitError: ``step_fn`` asked for a collective after ``backward()``.
            RuntimeError: ``step_fn`` did not call ``backward()``, called it twice, or stepped the optimizer
                before it or twice.
        """
        while True:
            if self.group is None:
                self._join()
            gen = self.generation
            assert gen is not None and self.group is not None
            flats = self._flats_for_step()
            self._snapshot.take()
            batch = self.data.local_batch(self.steps, gen.index, gen.size)
            self._share = self.data.local_rows(self.steps, gen.index, gen.size) / self.data.global_batch_size
            for f in flats:  # each attempt starts from no gradient; the hooks copy backward's into the views
                for p in f.params:
                    p.grad = None
            self._had = [False] * len(self._had)
            self._joiners, self._stepped = 0, False
            self._phase_of_step = _Phase.OPEN
            try:
                self._phase("forward")
                result = step_fn(batch)
            except StepAborted:
                self._discard()
                self.aborted += 1
                log.warning("step %d discarded in generation %d; forming the next generation", self.steps,
                            gen.number)
                continue
            except BaseException:  # the error goes to the caller, on every member alike
                if self._phase_of_step is _Phase.COMMITTED:  # applied on this member: it counts
                    self._end_step()
                else:
                    self._discard()
                raise
            if self._phase_of_step is not _Phase.COMMITTED:
                self._discard()
                raise RuntimeError(
                    f"fault-tolerant MultiWorkerMirrored: step_fn returned at step {self.steps} without calling "
                    "backward() on a loss of the model's parameters: the end of backward() is the step's commit "
                    "point, so the step was discarded")
            self._end_step()
            return result

    def _end_step(self) -> None:
        self._phase_of_step = _Phase.IDLE
        self.steps += 1
        if self._joiners:
            self._leave_group(abort=False)  # workers wait to join: the next step forms a generation with them

    def _discard(self) -> None:
        """Unwinds an attempt that did not commit: nothing of it stays, and this member leaves the group,
        tearing it down (its peers' collectives fail at once: they discard their step too, or, if theirs
        completed, their next one)."""
        self._phase_of_step = _Phase.IDLE
        self._snapshot.restore()
        for f in self._flats:
            for p in f.params:
                p.grad = None
        self._leave_group(abort=True)

    def _flats_for_step(self) -> list[Flat]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        layout = [(p, p.dtype, p.shape) for p in params]
        if len(layout) != len(self._layout) or any(a[0] is not b[0] or a[1:] != b[1:]
                                                    for a, b in zip(layout, self._layout)):
            self._layout = layout
            buffers = [b for m in self.model.modules() for name, b in m._buffers.items()
                       if b is not None and b.is_floating_point() and is_mean_buffer(m, name)]
            dtypes = list(dict.fromkeys([p.dtype for p in params] + [b.dtype for b in buffers]))
            self._flats = [Flat([p for p in params if p.dtype == d], [b for b in buffers if b.dtype == d],
                                 len(params) + 1 if i == 0 else 0) for i, d in enumerate(dtypes)]
            self._had = [False] * len(params)
            views = {id(p): v for f in self._flats for p, v in zip(f.params, f.views)}
            for h in self._hooks:
                h.remove()
            self._hooks = [p.register_post_accumulate_grad_hook(  # (the strategy's own: not guarded)
                               linear_gradient_hook(self._on_grad(i, views[id(p)])))
                           for i, p in enumerate(params)]
        return self._flats

    def _on_grad(self, i: int, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            if self._phase_of_step is _Phase.OPEN:
                self._phase_of_step = _Phase.COMMITTING
                torch.autograd.Variable._execution_engine.queue_callback(self._commit_point)
            elif self._phase_of_step is _Phase.COMMITTED:
                raise RuntimeError(
                    f"fault-tolerant MultiWorkerMirrored: a second backward() in step {self.steps}: the end of "
                    "the first was the step's commit point and its gradients are applied; call backward() once "
                    "per step_fn (accumulate micro-batches' losses into one loss)")
            g = p.grad
            if g is not None and g.data_ptr() != view.data_ptr():  # (a second accumulation adds into the view)
                _into(view, g)
                p.grad = view
            self._had[i] = True
        return on_grad

    def _commit_point(self) -> None:
        """The end of ``backward()``: the gradients' all-reduce and the agreement check; the step is applied
        on this member iff both completed on it (see the module docstring). Both are waited for at once (our
        backend then runs them on this thread: no hand-off to its worker)."""
        gen = self.generation
        assert gen is not None and self.group is not None
        flats = self._flats
        with torch.no_grad():
            for f in flats:
                for p, v in zip(f.params, f.views):
                    if p.grad is None:
                        v.zero_()  # no gradient here: zeros in the sum (the flags tell whether any member had one)
                    elif p.grad.data_ptr() != v.data_ptr():
                        _into(v, p.grad)  # a gradient step_fn assigned, not backward's
                for b, v in zip(f.buffers, f.views[len(f.params):]):
                    v.copy_(b).mul_(self._share)
            flats[0].extra.copy_(torch.tensor(self._had + [self._membership.joiners(gen)],
                                              dtype=flats[0].extra.dtype))
        self._phase("all_reduce")
        failure = None
        try:
            for f in flats:
                self.group.all_reduce(ReduceOp.SUM, [f.flat])
            if self._agreement is not None:
                self._agreement.check_step(self.optimizer)
            self._phase("commit")
        except ReplicaDivergenceError:
            raise  # the same on every member whose check completed: the step is discarded, the error goes on
        except (CollectiveFailed, RuntimeError) as exc:
            failure = str(exc)
        if failure is not None:
            log.warning("step %d: a collective failed in generation %d: %s", self.steps, gen.number, failure)
            raise StepAborted(f"step {self.steps} discarded in generation {gen.number}")
        self._phase("apply")
        *had, joiners = flats[0].extra.tolist()
        self._joiners = int(joiners)
        i = 0
        with torch.no_grad():
            for f in flats:
                for p, v in zip(f.params, f.views):
                    p.grad = v if had[i] > 0.5 else None
                    i += 1
                for b, v in zip(f.buffers, f.views[len(f.params):]):
                    b.copy_(v)
        self._phase_of_step = _Phase.COMMITTED

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._phase_of_step is not _Phase.COMMITTED or self._stepped:
            where = "twice in one step" if self._stepped else self._phase_of_step.value
            raise RuntimeError(
                f"fault-tolerant MultiWorkerMirrored: optimizer.step() {where} (step {self.steps}): the loop's "
                "optimizer steps once per loop.step(step_fn), inside step_fn after loss.backward() (the step's "
                "commit point), so that every member applies the same committed gradients")
        self._stepped = True

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._agreement is not None:
            self._agreement.after_step(optimizer)

    # --- collectives that step_fn asks for ---------------------------------------------------------------------
    def all_reduce(self, op: ReduceOp, tensors: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """``tensors`` reduced in place over the current generation (``what``: the caller, for errors).

        Before the commit point a failure discards the step (``StepAborted``: ``step_fn`` is redone); outside
        a step a failure, or no current generation, raises ``UnavailableError`` (the next step forms one).

        Raises:
            CollectiveAfterCommitError: asked for after the step's commit point.
        """
        state = self._phase_of_step
        if state is _Phase.COMMITTED or state is _Phase.COMMITTING:
            raise CollectiveAfterCommitError(
                f"fault-tolerant MultiWorkerMirrored: {what} in step_fn after loss.backward() of step {self.steps}: "
                "the end of backward() is the step's commit point, after which a collective that a lost member "
                "makes fail could not be undone. Call it before loss.backward() (it is then part of the step: a "
                "lost member discards and redoes the step), or on what step_fn returns, after loop.step()")
        gen, group = self.generation, self.group
        if gen is None or group is None:
            raise UnavailableError(
                f"fault-tolerant MultiWorkerMirrored: {what} outside a step between generations (after step "
                f"{self.steps} this worker left its group: a member was lost or workers wait to join); the next "
                "loop.step forms the next generation. Reduce in step_fn before loss.backward(), or after loop.step")
        if gen.size == 1:
            return tensors
        failure = None
        try:
            group.all_reduce(op, tensors)
        except CollectiveFailed as exc:
            failure = str(exc)
        if failure is None:
            return tensors
        if state is _Phase.OPEN:
            raise StepAborted(failure)
        self._leave_group(abort=True)  # outside a step: the next loop.step forms the next generation
        raise UnavailableError(f"{what} over generation {gen.number} failed: {failure}")

    def close(self) -> None:
        if self.generation is not None:  # a member in good standing ends the job's training here
            self._membership.mark_finished(self.steps)
        for h in self._hooks + self._optimizer_hooks:
            h.remove()
        self._hooks, self._optimizer_hooks = [], []
        self._leave_group(abort=False)


def _into(view: torch.Tensor, grad: torch.Tensor) -> None:
    """``grad`` written into its parameter's view of the step's flat buffer (a sparse one densified)."""
    if grad.layout is torch.strided:
        view.copy_(grad)
    else:
        view.zero_().add_(grad)
