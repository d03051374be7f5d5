"""Input for MultiWorkerMirroredStrategy: each worker reads only its part of every global batch.

* A ``torch.utils.data.DataLoader`` over a map-style dataset (``batch_size`` = the GLOBAL batch) is rebuilt
  per worker with :class:`WorkerBatchSampler`: the index permutation of epoch ``e`` is drawn from
  ``seed + e`` (the same on every worker), cut into global batches of ``B`` indices, and worker ``w`` keeps
  slice ``w`` of each (a DistributedSampler-like split that keeps TF's global-batch semantics). Workers never
  load each other's samples. ``set_epoch(e)`` picks the permutation; iterating again advances the epoch by
  itself (TF reshuffles each iteration).
* In-process strategies (Mirrored, CentralStorage) read a map-style DataLoader the same way, as one worker
  (:class:`ReplicaSplitDataset`), and split each global batch over their replicas: the same global batches
  in the same order as N workers, so a checkpoint's data position resumes under either.
* Any other iterable of global batches (tensors, tuples, dicts) goes to the core's ``DistributedDataset``:
  every worker reads it in full and keeps its slice of each batch along dim 0.

The split rule is the core's (``input_lib.split_sizes``): a global batch of ``r`` rows, full or the partial
final one, gives worker ``w`` slice ``w`` of the sizes ``r // n`` (+1 for the first ``r % n`` workers), so a
partial batch is spread evenly (5 rows on 2 workers: [3, 2]). Only a batch with fewer rows than workers
leaves some workers EMPTY (they must still run the step; ``compute_average_loss`` over the global batch
keeps the result exact).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol, cast

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, IterableDataset

from torchstrategies.distribute.input_lib import DistributedDataset, InputOptions, split_sizes

__all__ = ["WorkerBatchSampler", "WorkerShardedDataset", "ReplicaSplitDataset", "is_map_style_loader"]


@dataclasses.dataclass(eq=False)
class WorkerBatchSampler:
    """Yields this worker's index list of each global batch (see the module docstring)."""

    num_samples: int
    global_batch: int
    world: int
    rank: int
    shuffle: bool
    seed: int
    drop_last: bool
    epoch: int = dataclasses.field(default=0, init=False)
    skip: int = dataclasses.field(default=0, init=False)  # global batches to skip next epoch (resume)

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"the global batch size must be positive, got {self.global_batch}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int] | list[tuple[str, int]]]:
        order = self._order()
        start, self.skip = self.skip, 0
        for b in range(start, len(self)):
            chunk = order[b * self.global_batch:(b + 1) * self.global_batch]
            sizes = split_sizes(len(chunk), self.world)
            lo = sum(sizes[:self.rank])
            part = chunk[lo:lo + sizes[self.rank]]
            # An empty part still yields a batch (0 rows, same structure): load one sample, keep no row.
            yield part if part else [(_EMPTY, chunk[0])]


_EMPTY = "__torchstrategies_empty__"


class _EmptySample:
    def __init__(self, item: object):
        self.item = item


class _MapStyle(Protocol):
    """A map-style dataset: ``len`` and ``dataset[i]``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> object: ...


class _EmptyAware(torch.utils.data.Dataset[object]):
    def __init__(self, dataset: _MapStyle):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[str, int]) -> object:
        if isinstance(key, tuple):  # (_EMPTY, index): WorkerBatchSampler's stand-in for an empty part
            return _EmptySample(self.dataset[key[1]])
        return self.dataset[key]


class _EmptyAwareCollate:
    def __init__(self, collate_fn: Callable[[list[object]], object]):
        self.collate_fn = collate_fn

    def __call__(self, batch: list[object]) -> object:
        if len(batch) == 1 and isinstance(batch[0], _EmptySample):
            full = self.collate_fn([batch[0].item])
            return pytree.tree_map(lambda x: x[0:0] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, full)
        return self.collate_fn(batch)


class WorkerShardedDataset:
    """The per-worker view of a DataLoader; iterate it for this worker's batches.

    ``position`` is ``(epoch, global batches consumed in that epoch)`` and ``restore_position`` resumes there;
    ``state_dict()`` / ``load_state_dict()`` (what ``torchstrategies.checkpoint`` saves) add the seed, the
    global batch size and the number of samples, so a job on another number of workers (or a
    MirroredStrategy) continues with the same global batch. The loader this builds draws its per-epoch base
    seed (for worker processes) from its own generator, seeded from ``(seed, epoch)``, never from the
    global torch generator, so a resume in the middle of an epoch leaves the global random state untouched.
    """

    def __init__(self, loader: DataLoader[object], world: int, rank: int, seed: int,
                 device: torch.device | None = None):
        if loader.batch_size is None:
            raise ValueError("experimental_distribute_dataset needs a DataLoader with batch_size (the global batch)")
        shuffle = not isinstance(loader.sampler, torch.utils.data.SequentialSampler)
        self._generator = torch.Generator()
        self.global_batch_size = loader.batch_size
        self.sampler = WorkerBatchSampler(len(cast(Sized, loader.dataset)), loader.batch_size, world, rank, shuffle,
                                          seed, loader.drop_last)
        self._loader = DataLoader(
            _EmptyAware(cast(_MapStyle, loader.dataset)), batch_sampler=self.sampler, num_workers=loader.num_workers,
            collate_fn=_EmptyAwareCollate(loader.collate_fn), pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
            generator=self._generator,
        )
        self._explicit_epoch = False
        self._started = False
        self._consumed = 0
        self._device = device if device is not None and torch.device(device).type != "cpu" else None

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffling permutation of ``epoch`` for the next iteration (same on every worker)."""
        self.sampler.set_epoch(epoch)
        self._explicit_epoch = True

    @property
    def position(self) -> tuple[int, int]:
        return self.sampler.epoch, self._consumed

    def restore_position(self, epoch: int, consumed: int) -> None:
        if not 0 <= consumed <= len(self.sampler):
            raise ValueError(f"restore_position: {consumed} batches consumed, but an epoch has {len(self.sampler)}")
        self.sampler.set_epoch(epoch)
        self.sampler.skip = consumed
        self._consumed = consumed
        self._explicit_epoch = True
        self._started = True

    def state_dict(self) -> dict[str, int]:
        """The position and what it means: ``epoch``, ``consumed`` (global batches), ``seed``,
        ``global_batch_size``, ``num_samples``."""
        return {"epoch": self.sampler.epoch, "consumed": self._consumed, "seed": self.sampler.seed,
                "global_batch_size": self.global_batch_size, "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resumes at ``state``'s position with its seed; the global batch and the dataset size must agree.

        Raises:
            ValueError: a different global batch size or number of samples (naming both values).
        """
        for key, mine in (("global_batch_size", self.global_batch_size), ("num_samples", self.sampler.num_samples)):
            if int(state[key]) != mine:
                raise ValueError(f"the checkpoint's data position has {key}={int(state[key])}, this dataset "
                                 f"{key}={mine}: a resume continues the same sequence of global batches")
        self.sampler.seed = int(state["seed"])
        self.restore_position(int(state["epoch"]), int(state["consumed"]))

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[object]:
        if self._started and not self._explicit_epoch:
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._consumed = 0
        self._started = True
        self._explicit_epoch = False
        self._generator.manual_seed((self.sampler.seed * 1_000_003 + self.sampler.epoch) % (2**63))
        for batch in self._loader:
            self._consumed += 1
            if self._device is not None:
                batch = pytree.tree_map(
                    lambda x: x.to(self._device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)
            yield batch
        # Finishing an epoch: the next iteration starts the next one.
        self._consumed = 0
        self._explicit_epoch = False


class ReplicaSplitDataset(DistributedDataset):
    """An in-process strategy's view of a map-style DataLoader: the global batches in the same order as
    MultiWorkerMirroredStrategy reads them (a :class:`WorkerShardedDataset` of one worker), each split over
    the local replicas. Resumable like it (``position``, ``state_dict`` / ``load_state_dict``), so a job
    saved under MultiWorkerMirroredStrategy continues here with the same global batch, and back.
    """

    def __init__(self, strategy: Any, loader: DataLoader[object], seed: int, options: InputOptions | None):
        self.sharded = WorkerShardedDataset(loader, 1, 0, seed)
        self.global_batch_size = self.sharded.global_batch_size
        super().__init__(strategy, self.sharded, options)

    def set_epoch(self, epoch: int) -> None:
        self.sharded.set_epoch(epoch)

    @property
    def position(self) -> tuple[int, int]:
        return self.sharded.position

    def restore_position(self, epoch: int, consumed: int) -> None:
        self.sharded.restore_position(epoch, consumed)

    def state_dict(self) -> dict[str, int]:
        return self.sharded.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sharded.load_state_dict(state)


def loader_seed(loader: DataLoader[object]) -> int | None:
    """The shuffling seed a DataLoader names (its generator's initial seed), else None."""
    gen = loader.generator
    return int(gen.initial_seed()) if gen is not None else None


def is_map_style_loader(dataset: object) -> bool:
    return (isinstance(dataset, DataLoader) and not isinstance(dataset.dataset, IterableDataset)
            and dataset.batch_size is not None and hasattr(dataset.dataset, "__len__"))
