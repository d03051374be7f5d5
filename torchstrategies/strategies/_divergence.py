"""MultiWorkerMirroredStrategy's divergence check: every rank must hold the same parameters.

A fingerprint per tensor (two int64 numbers from its bits: the sum of its 32-bit words and the sum of the
squares of their low 16 bits; exact and independent of summation order, so equal tensors give equal
fingerprints on any hardware), then ONE small all-reduce (MAX of ``[f, -f]``) says whether every rank has
the same fingerprints; a mismatch raises ``ReplicaDivergenceError`` naming the first differing tensor and
the step. It runs at every ``every``-th optimizer step (before the update), at every checkpoint save, and at
every step in debug mode (``TORCHSTRATEGIES_DEBUG=1``). Neither TF nor DDP offers this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torchstrategies.errors import ReplicaDivergenceError

__all__ = ["DivergenceCheck", "fingerprints"]


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An int64 tensor of shape (len(tensors), 2): per tensor, the sum of its 32-bit words (its bytes read
    as int32; a tensor of odd byte size is widened first) and the sum of the squares of their low 16 bits."""
    rows = []
    for t in tensors:
        x = t.detach().contiguous().reshape(-1)
        if x.numel() * x.element_size() % 4:
            x = x.double() if (x.is_floating_point() or x.is_complex()) else x.to(torch.int64)
        if x.is_complex():
            x = torch.view_as_real(x).reshape(-1)
        words = x.view(torch.int32).to(torch.int64)
        low = words & 0xFFFF
        rows.append(torch.stack([words.sum(), (low * low).sum()]).cpu())
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


class DivergenceCheck:
    """Counts optimizer steps and checks the ranks' tensors every ``every`` steps.

    Args:
        max_all_reduce: ``fn(tensor) -> tensor``: the element-wise MAX over every rank.
        every: check at every ``every``-th step (0: never between checkpoints); 1 in debug mode.
    """

    def __init__(self, max_all_reduce: Callable[[torch.Tensor], torch.Tensor], every: int) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ValueError(f"the divergence check interval must be a non-negative int, got {every!r}")
        self._max = max_all_reduce
        self.every = every
        self.steps = 0

    def on_step(self, named: Callable[[], list[tuple[str, torch.Tensor]]]) -> None:
        """Called at every optimizer step (on every rank, the same steps)."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.check(named(), f"optimizer step {self.steps}")

    def check(self, named: list[tuple[str, torch.Tensor]], when: str) -> None:
        """Raises ``ReplicaDivergenceError`` unless every rank holds the same ``named`` tensors."""
        if not named:
            return
        f = fingerprints([t for _, t in named])
        most = self._max(torch.cat([f, -f]))
        hi, lo = most[: len(named)], -most[len(named):]
        same = (hi == lo).all(1)
        if bool(same.all()):
            return
        first = int((~same).nonzero()[0])
        raise ReplicaDivergenceError(
            f"The ranks hold different values of {named[first][0]} at {when} (divergence check: its "
            "fingerprint differs between ranks). Something wrote it differently on each rank: a write from "
            "per-rank values (use the gradients after backward(), which are the global sum, or all-reduced "
            "values), an optimizer made outside the scope, or a module changed on some ranks only")
