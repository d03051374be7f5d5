"""What each optimizer step checks of the ranks' agreement (MultiWorkerMirrored; the seam is ``agreement.py``).

At every ``optimizer.step()`` (the strategy's step pre-hook, before the update) a :class:`StepAgreement`
compares, in ONE MAX all-reduce of ``4 * len(tracked)`` int64 numbers:

* every tracked tensor whose version counter moved, or whose storage was replaced (``p.data = x``), since the
  last step (the optimizer's own writes are recorded after its step, :meth:`StepAgreement.record`): hashed
  whole, so a divergence there is named at the step where it happens. Which tensors moved is part of the
  all-reduce (a flag per tensor): a tensor that moved on some ranks only is hashed whole on every rank in a
  second all-reduce, taken only then;
* the ``forced`` tensors (the parameters of an optimizer no strategy watches: a model and optimizer made
  outside the scope), hashed whole at every step;
* slice ``s % slices`` of the rest: the tracked tensors' bytes laid end to end and cut into ``slices`` equal
  pieces, so every byte is compared once every ``slices`` steps at ``1 / slices`` of a full check's cost (a
  write torch does not count, through ``.data`` or a kernel that bypasses the version counter, is named
  within ``slices`` steps).

``slices`` is ``AGREEMENT_SLICES`` by default, 1 (everything, every step) in debug mode
(``TORCHSTRATEGIES_DEBUG=1``), 0 with ``TORCHSTRATEGIES_AGREEMENT=0`` (off: the benchmarking knob).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategies.distribute.agreement import RankAgreement, fingerprints

__all__ = ["StepAgreement", "AGREEMENT_SLICES", "slice_ranges", "piece_of"]

# How many steps the rotating slice takes to cover every tracked byte: the bound, in steps, on naming a
# write torch does not count (version-moved tensors are named at once); each step hashes 1/AGREEMENT_SLICES
# of the model. Measured (2-core AMD EPYC VM, 2026-11-28 13:33/13:35 UTC, load 0.49 at each start; docs/
# strategies.md, Agreement): the check costs 7.8% / 2.4% of the bench MLP's MWMS step at 8, over the 2% budget,
# and the cost is the check's own blocking all-reduce, not the hashing, so a larger value would not lower it:
#   torchstrategies bench train --nproc 2 --no-in-process --strategy mwms-default --strategy mwms-no-agreement
AGREEMENT_SLICES = 8


def _identity(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()


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
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()   # tensor -> (version, data_ptr) last seen

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        """Remembers ``tensors`` as they are now (after an optimizer's step: its own writes are no news)."""
        for t in tensors:
            self._seen[t] = _identity(t)

    def on_step(self, tracked: Sequence[torch.Tensor], forced: Sequence[torch.Tensor],
                raise_for: Callable[[list[int], str, dict[int, str]], None]) -> None:
        """Checks ``tracked + forced`` (the same list on every rank) as this step requires.

        Args:
            raise_for: ``fn(indices, when, reasons)`` raises the error for the differing tensors (indices into
                ``tracked + forced``); ``reasons[i]`` is "moved", "unwatched" or "slice".
        """
        if not self.slices:
            return
        self.steps += 1
        everything = list(tracked) + list(forced)
        n = len(everything)
        if not n:
            return
        reasons: dict[int, str] = {}
        views: list[torch.Tensor] = []
        where: list[int] = []
        flags = torch.zeros(n, dtype=torch.int64)
        pieces = self._pieces(tracked, (self.steps - 1) % self.slices)
        for i, t in enumerate(everything):
            if i >= len(tracked):
                reasons[i] = "unwatched"
                views.append(t.detach())
            elif self._seen.get(t) != _identity(t):
                flags[i] = 1
                reasons[i] = "moved"
                views.append(t.detach())
            elif i in pieces:
                reasons[i] = "slice"
                views.append(pieces[i])
            else:
                continue
            where.append(i)
        slots = torch.zeros(n, dtype=torch.int64)
        if views:
            slots[where] = fingerprints(views)
        hi, lo = self.ranks.max_min(torch.cat([flags, slots]))
        agreed = hi[:n] == lo[:n]
        differ = agreed & (hi[n:] != lo[n:])
        redo = (~agreed).nonzero().flatten().tolist()
        if redo:   # moved on some ranks only: compare them whole, everywhere
            for i in redo:
                reasons[i] = "moved"
            again = self.ranks.differing([everything[i].detach() for i in redo])
            for j in again:
                differ[redo[j]] = True
        self.record(tracked)
        bad = differ.nonzero().flatten().tolist()
        if bad:
            raise_for(bad, f"optimizer step {self.steps}", reasons)

    def _pieces(self, tracked: Sequence[torch.Tensor], piece: int) -> dict[int, torch.Tensor]:
        """Slice ``piece`` of ``slices``: tensor index -> the flat view of its bytes in that piece."""
        return {i: piece_of(tracked[i], r) for i, r in slice_ranges(tracked, piece, self.slices).items()}


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
