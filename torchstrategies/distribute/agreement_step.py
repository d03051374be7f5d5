"""What each optimizer step checks of the ranks' agreement (MultiWorkerMirrored; the seam is ``agreement.py``).

At every ``optimizer.step()`` a :class:`StepAgreement` compares, in ONE MAX all-reduce of
``4 * len(tracked + forced)`` int64 numbers, what the ranks hold before the update:

* every tracked tensor whose version counter moved, or whose storage was replaced (``p.data = x``), since the
  last step (the optimizer's own writes are recorded after its step, :meth:`StepAgreement.record`): hashed
  whole, so a divergence there is named at the step where it happens. Which tensors moved is part of the
  all-reduce (a flag per tensor): a tensor that moved on some ranks only is hashed whole on every rank in a
  second all-reduce, taken only then (after the update: the values every rank still holds);
* the ``forced`` tensors (the parameters of an optimizer no strategy watches: a model and optimizer made
  outside the scope), hashed whole at every step;
* slice ``turn % slices`` of the rest: the tracked tensors' bytes laid end to end and cut into ``slices``
  equal pieces, so every byte is compared once every ``slices`` steps at ``1 / slices`` of a full check's
  cost (a write torch does not count, through ``.data`` or a kernel that bypasses the version counter, is
  named within ``slices`` steps). ``turn`` counts the steps of the optimizer that steps (the caller's), so
  two optimizers that alternate each go through every piece of their own tensors.

The collective is off the step's critical path: :meth:`StepAgreement.start` (the step pre-hook) hashes and
starts the all-reduce, the optimizer's update runs while it travels, and :meth:`StepAgreement.finish` (the
step post-hook) waits for it and raises ``ReplicaDivergenceError`` if anything differs. The decision is made
from the all-reduce's result, which every rank receives alike, so every rank raises the same error from the
same ``optimizer.step()`` (after its update) or none does. A check left pending by a step that raised before
its post-hook is finished by the next :meth:`StepAgreement.start`.

``slices`` is ``AGREEMENT_SLICES`` by default, 1 (everything, every step) in debug mode
(``TORCHSTRATEGIES_DEBUG=1``), 0 with ``TORCHSTRATEGIES_AGREEMENT=0`` (off: the benchmarking knob).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchstrategies.distribute.agreement import RankAgreement, fingerprint_list

__all__ = ["StepAgreement", "AGREEMENT_SLICES", "slice_ranges", "piece_of"]

# How many steps the rotating slice takes to cover every tracked byte: the bound, in steps, on naming a
# write torch does not count (version-moved tensors are named at once); each step hashes 1/AGREEMENT_SLICES
# of the model, the larger part of what the check costs a step (the bytes come from memory, not cache), so the
# default is the largest value the promise allows (issue 46: any divergence named within 10 steps). What the
# check costs at this value is measured in docs/strategies.md (Agreement).
AGREEMENT_SLICES = 10

# raise_for(index into tracked + forced, reason, the fingerprint this rank compared, when): raises the error.
RaiseFor = Callable[[int, str, int, str], None]


class _Seen:
    """Tensor -> (version, data_ptr) when last seen, by identity: an entry whose tensor died never matches a
    new tensor at the same address (it holds a weak reference, checked on lookup); dead entries are dropped
    when the table has doubled since the last sweep."""

    def __init__(self) -> None:
        self._table: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._sweep_at = 64

    def moved(self, t: torch.Tensor) -> bool:
        e = self._table.get(id(t))
        return e is None or e[0]() is not t or e[1] != t._version or e[2] != t.data_ptr()

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        table = self._table
        for t in tensors:
            table[id(t)] = (weakref.ref(t), t._version, t.data_ptr())
        if len(table) > self._sweep_at:
            self._table = table = {k: e for k, e in table.items() if e[0]() is not None}
            self._sweep_at = max(64, 2 * len(table))


@dataclass
class _Pending:
    """A step's check in flight: what finishing it needs."""

    wait: Callable[[], tuple[list[int], list[int]]]
    everything: list[torch.Tensor]
    slots: list[int]
    reasons: dict[int, str]
    when: str
    raise_for: RaiseFor


class StepAgreement:
    """The per-step agreement check of one MultiWorkerMirroredStrategy (see the module docstring).

    Args:
        ranks: the seam's comparison over the strategy's process group.
        slices: the rotating slice's period in steps (1: everything every step; 0: off).
    """

    def __init__(self, ranks: RankAgreement, slices: int) -> None:
        if not isinstance(slices, int) or isinstance(slices, bool) or slices < 0:
            raise ValueError(f"the agreement check's slices must be a non-negative int, got {slices!r}")
        self.ranks = ranks
        self.slices = slices
        self.steps = 0
        self._seen = _Seen()
        self._pending: _Pending | None = None

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        """Remembers ``tensors`` as they are now (after an optimizer's step: its own writes are no news)."""
        self._seen.record(tensors)

    def start(self, tracked: Sequence[torch.Tensor], forced: Sequence[torch.Tensor], turn: int,
              raise_for: RaiseFor) -> None:
        """Hashes what this step checks of ``tracked + forced`` (the same list on every rank; ``turn``: how many
        steps the stepping optimizer took before, which picks the piece) and starts the all-reduce that
        compares it (after finishing a check still pending)."""
        self.finish()
        if not self.slices:
            return
        self.steps += 1
        everything = [*tracked, *forced]
        n = len(everything)
        if not n:
            return
        pieces = slice_ranges(tracked, turn % self.slices, self.slices)
        flags = [0] * n
        reasons: dict[int, str] = {}
        views: list[torch.Tensor] = []
        where: list[int] = []
        moved: list[torch.Tensor] = []
        for i, t in enumerate(tracked):
            if self._seen.moved(t):
                flags[i] = 1
                reasons[i] = "moved"
                views.append(t.detach())
                moved.append(t)
            elif i in pieces:
                reasons[i] = "slice"
                views.append(piece_of(t, pieces[i]))
            else:
                continue
            where.append(i)
        for i in range(len(tracked), n):
            reasons[i] = "unwatched"
            views.append(everything[i].detach())
            where.append(i)
        slots = [0] * n
        for i, f in zip(where, fingerprint_list(views)):
            slots[i] = f
        self._seen.record(moved)
        self._pending = _Pending(self.ranks.max_min_async(flags + slots), everything, slots, reasons,
                                 f"optimizer step {self.steps}", raise_for)

    def finish(self) -> None:
        """Waits for the pending check, if any, and raises ``ReplicaDivergenceError`` (on every rank) for the
        first tensor that differs between the ranks."""
        p, self._pending = self._pending, None
        if p is None:
            return
        hi, lo = p.wait()
        n = len(p.everything)
        redo = [i for i in range(n) if hi[i] != lo[i]]   # moved on some ranks only: compare them whole, now
        bad = [(i, p.slots[i]) for i in range(n) if hi[i] == lo[i] and hi[n + i] != lo[n + i]]
        if redo:
            whole = fingerprint_list([p.everything[i].detach() for i in redo])
            most, least = self.ranks.max_min(whole)
            bad += [(i, f) for i, f, a, b in zip(redo, whole, most, least) if a != b]
            for i in redo:
                p.reasons[i] = "moved"
        if bad:
            i, fingerprint = min(bad)
            p.raise_for(i, p.reasons.get(i, "slice"), fingerprint, p.when)


def slice_ranges(tensors: Sequence[torch.Tensor], piece: int, slices: int) -> dict[int, tuple[int, int] | None]:
    """Piece ``piece`` of ``slices`` of the tensors' bytes laid end to end: tensor index -> the element range
    [a, b) of its flat view in that piece (None: the whole tensor, for one that is not contiguous, in the
    piece where it starts). Every element is in exactly one piece."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(sizes)
    out: dict[int, tuple[int, int] | None] = {}
    if not total:
        return out
    lo, hi = piece * total // slices, (piece + 1) * total // slices
    start = 0
    for i, (t, size) in enumerate(zip(tensors, sizes)):
        end = start + size
        if end > lo and start < hi and size:
            if not t.is_contiguous():
                if lo <= start < hi:
                    out[i] = None
            else:
                e = t.element_size()
                a, b = min(max(lo - start, 0), size) // e, min(max(hi - start, 0), size) // e
                if b > a:
                    out[i] = (a, b)
        start = end
    return out


def piece_of(t: torch.Tensor, r: tuple[int, int] | None) -> torch.Tensor:
    """The part of ``t`` a range of :func:`slice_ranges` names (a view, no copy)."""
    return t.detach() if r is None else t.detach().reshape(-1)[r[0]:r[1]]
