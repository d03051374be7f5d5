"""Input distribution: ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``.

``DistributedDataset`` takes an iterable of GLOBAL batches (a DataLoader, a list, a generator factory...)
whose elements are tensors or structures (tuples, lists, dicts) of tensors with a common dim 0. Each
global batch of ``r`` rows is split along dim 0 over ``num_replicas_in_sync`` replicas evenly, larger parts
first: ``[ceil(r/N)] * (r % N) + [floor(r/N)] * (N - r % N)`` consecutive slices (TF's
``batch_sizes_for_worker`` rule, applied to the rows the batch really has). A partial final batch is
therefore spread over the replicas as TF 2.21 was observed to do (5 rows on 2 replicas: [3, 2]; on 3:
[2, 2, 1]); only a batch with fewer rows than replicas leaves some replicas EMPTY (0 rows, same
structure). A multi-process strategy keeps the slices of its own replicas (replica ids
``_replica_id_offset ... + num_local``). Non-tensor leaves are given to every replica unchanged.

Example:
    >>> import torch, torchstrategies as ts
    >>> s = ts.MirroredStrategy(["cpu:0", "cpu:1"])
    >>> batches = [torch.arange(4.0), torch.arange(4.0, 7.0)]
    >>> [tuple(x.tolist() for x in s.experimental_local_results(b))
    ...  for b in s.experimental_distribute_dataset(batches)]
    [([0.0, 1.0], [2.0, 3.0]), ([4.0, 5.0], [6.0])]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute.values import PerReplica, regroup

T = TypeVar("T")


class _InputExtended(Protocol):
    """What the distributed input needs of a ``StrategyExtended`` (its replicas and input hooks)."""

    _replica_id_offset: int

    @property
    def _num_local_replicas(self) -> int: ...
    @property
    def worker_devices(self) -> tuple[torch.device, ...]: ...
    def _input_workers(self) -> tuple[int, int]: ...
    def _input_max_over_pipelines(self, values: list[int]) -> list[int]: ...


class _InputStrategy(Protocol):
    """What the distributed input needs of a ``Strategy``."""

    @property
    def extended(self) -> _InputExtended: ...
    @property
    def num_replicas_in_sync(self) -> int: ...

__all__ = [
    "InputContext",
    "InputOptions",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputExhaustedError",
    "split_sizes",
]


@dataclasses.dataclass
class InputOptions:
    """Options of the distributed input (``tf.distribute.InputOptions``).

    Args:
        experimental_fetch_to_device: move each replica's batch to the replica's device (default True).
        experimental_per_replica_buffer_size: accepted for compatibility; batches are produced lazily.
    """

    experimental_fetch_to_device: bool = True
    experimental_per_replica_buffer_size: int = 1


class InputContext:
    """What ``distribute_datasets_from_function``'s ``dataset_fn`` learns (``tf.distribute.InputContext``).

    Example:
        >>> import torchstrategies as ts
        >>> ts.InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
        16
    """

    def __init__(
        self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1
    ):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by `num_replicas_in_sync` "
                f"{self._num_replicas_in_sync!r}"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, input_pipeline_id="
            f"{self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})"
        )


def split_sizes(rows: int, num_replicas: int) -> list[int]:
    """Per-replica row counts of a batch of ``rows`` rows: evenly, the larger parts first.

    Example:
        >>> split_sizes(5, 3)
        [2, 2, 1]
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be positive, got {num_replicas}")
    if rows < 0:
        raise ValueError(f"rows must be non-negative, got {rows}")
    base, rem = divmod(rows, num_replicas)
    return [base + 1] * rem + [base] * (num_replicas - rem)


def _batch_rows(leaves: list[object]) -> int:
    rows = None
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                raise ValueError(f"Cannot split a scalar (0-dim) tensor across replicas: {x!r}")
            if rows is None:
                rows = x.shape[0]
            elif x.shape[0] != rows:
                raise ValueError(
                    f"All tensors of a batch must have the same size in dim 0 to be split across replicas; "
                    f"got {rows} and {x.shape[0]}"
                )
    if rows is None:
        raise ValueError("A batch must contain at least one tensor to be split across replicas")
    return rows


def _to_device(structure: T, device: torch.device, enabled: bool) -> T:
    if not enabled:
        return structure
    return pytree.tree_map(
        lambda x: (
            x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and x.device != device else x
        ),
        structure,
    )


class DistributedIterator:
    """Iterator over PerReplica batches; ``get_next()`` is ``next()``."""

    def __init__(self, gen: Iterator[object]):
        self._gen = gen

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        return next(self._gen)

    def get_next(self) -> Any:
        return next(self._gen)


class DistributedDataset:
    """Global batches split across replicas (what ``experimental_distribute_dataset`` returns)."""

    def __init__(self, strategy: _InputStrategy, dataset: Iterable[object], options: InputOptions | None = None):
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"experimental_distribute_dataset expects an iterable of batches, got {dataset!r}"
            )
        self._strategy = strategy
        self._dataset = dataset
        self._options = options or InputOptions()

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._generate())

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]

    def _generate(self) -> Iterator[object]:
        ext = self._strategy.extended
        n = self._strategy.num_replicas_in_sync
        offset, local = ext._replica_id_offset, ext._num_local_replicas
        devices = ext.worker_devices
        for batch in self._dataset:
            leaves, spec = pytree.tree_flatten(batch)
            sizes = split_sizes(_batch_rows(leaves), n)
            starts = [sum(sizes[:i]) for i in range(n)]
            outs = []
            for j in range(local):
                r = offset + j
                part = [
                    x[starts[r] : starts[r] + sizes[r]] if isinstance(x, torch.Tensor) else x for x in leaves
                ]
                outs.append(
                    _to_device(
                        pytree.tree_unflatten(part, spec),
                        devices[j],
                        self._options.experimental_fetch_to_device,
                    )
                )
            yield _wrap(outs)


def _wrap(outs: list[object]) -> object:
    if len(outs) == 1:
        return outs[0]
    return regroup(outs, PerReplica)


def _empty_like(structure: T) -> T:
    return pytree.tree_map(lambda x: x[0:0] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, structure)


class DistributedDatasetsFromFunction:
    """Per-replica batches from ``dataset_fn(InputContext)`` (``distribute_datasets_from_function``).

    ``dataset_fn`` is called once per input pipeline (once in this process). Its iterable yields
    PER-REPLICA batches; in each step the local replicas take consecutive elements. When the data runs
    out in the middle of a step, the remaining replicas receive empty batches (0 rows, same structure).

    Several pipelines (MultiWorkerMirroredStrategy, one per worker) may hold different numbers of batches.
    TF's rule applies: the epoch ends on every worker at once, when every pipeline is exhausted, and until
    then a worker whose data ran out gets empty batches (the structure of its last batch, 0 rows), so every
    worker runs the same steps and the collectives stay matched. When every pipeline's iterable has a
    ``len()``, the lengths are exchanged once per epoch (one small all-reduce); otherwise each step
    all-reduces whether each worker still has data (TF does this every step). A worker that has no batch
    at all while others have data cannot build an empty batch: every worker then raises
    ``InputExhaustedError`` (a ValueError) naming the problem, at the same step.
    """

    def __init__(
        self,
        strategy: _InputStrategy,
        dataset_fn: Callable[[InputContext], Iterable[object]],
        options: InputOptions | None = None,
    ):
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {dataset_fn!r}")
        self._strategy = strategy
        self._options = options or InputOptions()
        ext = strategy.extended
        pipelines, pid = ext._input_workers()
        self._ctx = InputContext(pipelines, pid, strategy.num_replicas_in_sync)
        self._dataset = dataset_fn(self._ctx)
        if not hasattr(self._dataset, "__iter__"):
            raise TypeError(
                f"dataset_fn must return an iterable of per-replica batches, got {self._dataset!r}"
            )

    @property
    def input_context(self) -> InputContext:
        return self._ctx

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self._generate())

    def _generate(self) -> Iterator[object]:
        ext = self._strategy.extended
        local, devices = ext._num_local_replicas, ext.worker_devices
        fetch = self._options.experimental_fetch_to_device
        pipelines, _ = ext._input_workers()
        steps = self._agreed_steps(ext, local) if pipelines > 1 else None
        it = iter(self._dataset)
        template: object = None  # the last batch seen: the structure of an empty one
        step = 0
        while steps is None or step < steps:
            outs: list[object] = []
            for j in range(local):
                try:
                    outs.append(_to_device(next(it), devices[j], fetch))
                except StopIteration:
                    break
            if pipelines > 1 and steps is None:  # length unknown somewhere: agree on this step (TF's rule)
                agreed = ext._input_max_over_pipelines([int(bool(outs))] + self._one_hot(not outs and template is None))
                if not agreed[0]:
                    return
                if any(agreed[1:]):
                    raise InputExhaustedError(self._dry_message(agreed[1:], "have no batch at all", step))
            elif not outs and pipelines == 1:
                return
            if outs:
                template = outs[0]
            elif template is None:  # known lengths: this pipeline yielded fewer batches than its len()
                raise InputExhaustedError(
                    f"distribute_datasets_from_function: input pipeline {self._ctx.input_pipeline_id} "
                    f"yielded no batch although its len() is {len(self._dataset)}")  # type: ignore[arg-type]
            while len(outs) < local:
                outs.append(_to_device(_empty_like(template), devices[len(outs)], fetch))
            step += 1
            yield _wrap(outs)

    def _agreed_steps(self, ext: _InputExtended, local: int) -> int | None:
        """The epoch's step count when every pipeline's iterable has a ``len()`` (None otherwise)."""
        try:
            n = len(self._dataset)  # type: ignore[arg-type]
        except TypeError:
            n = -1
        steps = -(-n // local) if n >= 0 else 0
        agreed = ext._input_max_over_pipelines([int(n < 0), steps] + self._one_hot(n == 0))
        if agreed[0]:
            return None
        if any(agreed[2:]) and agreed[1] > 0:
            raise InputExhaustedError(self._dry_message(agreed[2:], "have len() 0", 0, agreed[1]))
        return agreed[1]

    def _one_hot(self, flag: bool) -> list[int]:
        """One slot per pipeline, this pipeline's set to ``flag`` (a MAX all-reduce then names every one)."""
        slots = [0] * self._ctx.num_input_pipelines
        slots[self._ctx.input_pipeline_id] = int(flag)
        return slots

    def _dry_message(self, slots: list[int], what: str, step: int, steps: int | None = None) -> str:
        dry = [i for i, v in enumerate(slots) if v]
        of = f" of {steps}" if steps is not None else ""
        return (f"distribute_datasets_from_function: the input pipelines (workers) {dry} {what} while others "
                f"still have data (step {step}{of}; raised on every worker). A worker whose data runs out gets "
                f"empty batches shaped like its last one, so each worker needs at least one batch.")


class InputExhaustedError(ValueError):
    """Raised on every worker when one worker's input cannot take part in a step (see
    ``DistributedDatasetsFromFunction``)."""
