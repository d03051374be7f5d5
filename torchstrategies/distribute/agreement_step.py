"""What each optimizer step checks of the ranks' agreement (MultiWorkerMirrored; the seam is ``agreement.py``).

At every ``optimizer.step()``, before its update, a :class:`StepAgreement` compares, in ONE MAX all-reduce of
``6 * len(tracked + forced)`` int64 numbers (flags, fingerprints and their negations, reduced in place):

* every tracked tensor whose version counter moved, or whose storage was replaced (``p.data = x``), since the
  last step (what moved during an optimizer's step is its own write: recorded after it), hashed whole: a
  divergence there is named at the step where it happens. Which tensors moved is part of the all-reduce (a
  flag per tensor): a tensor that moved on some ranks only is hashed whole on every rank in a second
  all-reduce, taken only then;
* the ``forced`` tensors (the parameters of an optimizer no strategy watches: a model and optimizer made
  outside the scope), hashed whole, at every step;
* a piece of the rotating slice: the tracked tensors' bytes laid end to end and cut into ``slices`` equal
  pieces, piece ``turn % slices`` before the optimizer's ``turn``-th update (``turn`` from 0), so every byte
  is compared once every ``slices`` steps at ``1 / slices`` of a full check's cost. A write torch does not
  count (through ``.data`` or a kernel that bypasses the version counter), or an update that came out
  differently on some rank, is named within ``slices`` steps: at the latest at the ``slices``-th check
  after it, where its piece comes round again (the in-process strategies' bound too, ``replicated.py``).
  ``turn`` counts the updates of the optimizer that steps, so two optimizers that alternate each go
  through every piece of their own tensors.

:meth:`StepAgreement.check` (the step pre-hook, where the ranks have just met in the gradients' all-reduce)
hashes what moved and the piece in one C++ call (``ops.agreement_hash_``), runs the all-reduce and raises
``ReplicaDivergenceError`` if anything differs; :meth:`StepAgreement.record` (the post-hook) records the
update's writes (``ops.agreement_record_``: versions and addresses, no bytes read). The decision is made
from the all-reduce's result, which every rank receives alike, so every rank raises the same error from
the same ``optimizer.step()``, before its update (nothing of that step is applied), or none does.

What depends only on the list of tensors (which of them moved since recorded: their version and address
per position) lives in a :class:`StepTensors` per optimizer, kept while the list is the same list of the same
tensor objects and made anew when it changes (``add_param_group``, an unfrozen parameter, a new model: every
tensor of a new list counts as moved, so it is compared whole at once).

``slices`` is ``AGREEMENT_SLICES`` by default, 1 (everything, every step) in debug mode
(``TORCHSTRATEGIES_DEBUG=1``), 0 with ``TORCHSTRATEGIES_AGREEMENT=0`` (off: the benchmarking knob).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from torchstrategies import ops
from torchstrategies.distribute.agreement import RankAgreement, fingerprint_list

__all__ = ["StepAgreement", "StepTensors", "AGREEMENT_SLICES"]

# How many steps the rotating slice takes to cover every tracked byte: a write torch does not count is named
# within AGREEMENT_SLICES steps (the check of the step it is made in and the AGREEMENT_SLICES - 1 after it:
# the piece that holds it is among them; version-moved tensors are named at once); each step hashes
# 1/AGREEMENT_SLICES of the model, the larger part of what the check costs a step, so the default is the
# largest value the promise allows (issue 46: any divergence named within 10 steps). What the check costs at
# this value is measured in docs/strategies.md (Agreement).
AGREEMENT_SLICES = 10

# raise_for(index into tensors, reason, the fingerprint this rank compared, when): raises the error.
RaiseFor = Callable[[int, str, int, str], None]


class StepTensors:
    """What the check of one optimizer's steps compares, kept across its steps: ``tensors`` (tracked, then
    from ``forced_from`` on forced), per position the version and address it had when last recorded and
    whether it moved this step (``state``, int64 (n, 3)), the ``payload`` (int64 9n, ``ops.agreement_hash_``'s:
    its first 6n, ``wire``, are all-reduced in place; its last 3n stay this rank's flags and fingerprints),
    and ``turn``, the optimizer's updates so far (which piece of the rotating slice the next check takes)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.forced_from = 0
        self.state = torch.zeros(0, 3, dtype=torch.int64)
        self.payload = torch.zeros(0, dtype=torch.int64)
        self.wire = self.payload
        self.turn = 0

    def use(self, tracked: Sequence[torch.Tensor], forced: Sequence[torch.Tensor]) -> None:
        """Makes ``tracked + forced`` the list compared (kept if it is the same list of the same tensor objects;
        else made anew, with every position counting as moved)."""
        if (len(tracked) == self.forced_from and len(tracked) + len(forced) == len(self.tensors)
                and all(map(operator.is_, self.tensors, [*tracked, *forced]))):
            return
        self.tensors, self.forced_from = [*tracked, *forced], len(tracked)
        n = len(self.tensors)
        self.state = torch.zeros(n, 3, dtype=torch.int64)
        self.state[:, 0] = -1   # no version is negative: every tensor of a new list counts as moved
        self.payload = torch.zeros(9 * n, dtype=torch.int64)   # filled by each check
        self.wire = self.payload[:6 * n]


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

    def record(self, lists: StepTensors) -> None:
        """After an optimizer's update of ``lists``: remembers every tensor as it is now (its own writes are no
        news at the next :meth:`check`), and the next check takes the next piece of the rotating slice."""
        if not self.slices or not lists.tensors:
            return
        lists.turn += 1
        ops.agreement_record_(lists.tensors, lists.state)

    def check(self, lists: StepTensors, raise_for: RaiseFor) -> None:
        """Compares what this step checks of ``lists`` (the same list on every rank) across the ranks and raises
        ``ReplicaDivergenceError`` (on every rank, through ``raise_for``) for the first tensor that differs."""
        if not self.slices:
            return
        self.steps += 1
        if not lists.tensors:
            return
        ops.agreement_hash_(lists.tensors, lists.state, lists.payload, lists.forced_from, lists.turn % self.slices,
                            self.slices)
        differ = self.ranks.max_min_payload(lists.wire)
        if differ is None:
            return
        hi, lo = differ
        n = len(lists.tensors)
        redo = [i for i in range(n) if hi[i] != lo[i]]   # moved on some ranks only: compare them whole
        mine = lists.payload[6 * n:].tolist()
        found: list[tuple[int, int, str]] = []   # (index, this rank's fingerprint, reason)
        for i in range(n):
            if hi[i] != lo[i]:
                continue
            if hi[n + i] != lo[n + i]:
                found.append((i, mine[n + i], "unwatched" if i >= lists.forced_from else "moved"))
            elif hi[2 * n + i] != lo[2 * n + i]:
                found.append((i, mine[2 * n + i], "slice"))
        if redo:
            whole = fingerprint_list([lists.tensors[i].detach() for i in redo])
            most, least = self.ranks.max_min(whole)
            found += [(i, f, "moved") for i, f, a, b in zip(redo, whole, most, least) if a != b]
        if found:
            i, fingerprint, reason = min(found)
            raise_for(i, reason, fingerprint, f"optimizer step {self.steps}")

