"""The data of a fault-tolerant job: global batch ``k`` is a function of ``k`` alone, whatever the membership.

Epoch ``e`` draws its permutation from ``seed + e`` (the rule of ``WorkerBatchSampler``, so the batches are
those MultiWorkerMirroredStrategy reads from a shuffled DataLoader with that seed); global batch ``k`` is
batch ``k % len`` of epoch ``k // len``. A generation of ``n`` members splits each global batch with the
core's rule (``input_lib.split_sizes``: member ``i`` gets slice ``i``, larger parts first), and each member
loads only its own samples. The data position is the number of committed steps, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from torch.utils.data import default_collate

from torchstrategies.distribute.input_lib import split_sizes

__all__ = ["GlobalBatches"]


class GlobalBatches:
    """A map-style dataset read as a fixed sequence of global batches, split among the live workers.

    Args:
        dataset: ``len(dataset)`` and ``dataset[i]``.
        global_batch_size: rows of each global batch (fixed for the job).
        seed: the shuffling seed (every worker must pass the same).
        shuffle: draw a permutation per epoch (else the dataset's order).
        drop_last: drop the partial last batch of each epoch.
        collate_fn: turns a list of samples into a batch (``default_collate``).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = GlobalBatches(TensorDataset(torch.arange(10.0)), global_batch_size=4, shuffle=False)
        >>> data.local_batch(0, index=1, members=2)
        [tensor([2., 3.])]
    """

    def __init__(self, dataset: Any, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.dataset = dataset
        self.num_samples = len(cast(Sized, dataset))
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle, self.drop_last, self.collate_fn = seed, shuffle, drop_last, collate_fn
        if len(self) == 0:
            raise ValueError(f"{self.num_samples} samples make no global batch of {global_batch_size}")
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Global batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def indices(self, step: int) -> list[int]:
        """The sample indices of global batch ``step``."""
        epoch, b = divmod(step, len(self))
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                self._order = (epoch, torch.randperm(self.num_samples, generator=g).tolist())
            else:
                self._order = (epoch, list(range(self.num_samples)))
        return self._order[1][b * self.global_batch_size:(b + 1) * self.global_batch_size]

    def local_indices(self, step: int, index: int, members: int) -> list[int]:
        """The sample indices of member ``index`` of ``members``' part of global batch ``step``."""
        chunk = self.indices(step)
        sizes = split_sizes(len(chunk), members)
        lo = sum(sizes[:index])
        return chunk[lo:lo + sizes[index]]

    def local_rows(self, step: int, index: int, members: int) -> int:
        """How many rows member ``index`` of ``members`` gets of global batch ``step``."""
        return split_sizes(len(self.indices(step)), members)[index]

    def local_batch(self, step: int, index: int, members: int) -> Any:
        """Member ``index`` of ``members``' part of global batch ``step`` (0 rows when the batch has fewer
        rows than members and this member's part is empty)."""
        part = self.local_indices(step, index, members)
        if part:
            return self.collate_fn([self.dataset[i] for i in part])
        full = self.collate_fn([self.dataset[self.indices(step)[0]]])
        return torch.utils._pytree.tree_map(lambda x: x[0:0] if isinstance(x, torch.Tensor) and x.dim() else x,
                                            full)
