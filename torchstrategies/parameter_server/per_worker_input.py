"""Per-worker input under ParameterServerStrategy: the datasets, their iterators, what ``dataset_fn`` is told.

``coordinator.create_per_worker_dataset(dataset_fn)`` gives a :class:`PerWorkerDataset`; ``iter()`` of it a
:class:`PerWorkerDatasetIterator`, which a scheduled function receives and advances on its worker. Both
are handles into the chief's book (the registry), which numbers them and sends their definitions to the
workers; this module does not depend on the book's class (it is passed in as a :class:`DatasetBook`).

TF 2.21 has no synchronization beyond a worker, so every worker's ``dataset_fn`` gets
``InputContext(num_input_pipelines=1, input_pipeline_id=0)``: code that shards by ``input_pipeline_id``
reads the same data on every worker, as in TF. To shard per worker (an extension; TF has no equivalent),
use ``input_context.worker_index`` and ``input_context.num_workers``.

Example:
    >>> from torchstrategies.parameter_server.per_worker_input import PerWorkerInputContext
    >>> ctx = PerWorkerInputContext(worker_index=1, num_workers=2)
    >>> (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.worker_index, ctx.num_workers)
    (1, 0, 1, 2)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Protocol

from torchstrategies.distribute.input_lib import InputContext
from torchstrategies.parameter_server.remote_value import PerWorkerValues

__all__ = [
    "DatasetBook",
    "DatasetFnWithInputContext",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerInputContext",
    "dataset_fn_for_workers",
]


class PerWorkerInputContext(InputContext):
    """TF's per-worker ``InputContext`` (one pipeline, id 0) plus this worker's index.

    Args:
        worker_index: this worker's index among the cluster's workers (0-based).
        num_workers: the number of workers.
        num_replicas_in_sync: replicas per worker (1: a worker is one replica).

    Example:
        >>> from torchstrategies.parameter_server.per_worker_input import PerWorkerInputContext
        >>> PerWorkerInputContext(worker_index=0, num_workers=3).get_per_replica_batch_size(32)
        32
    """

    def __init__(self, worker_index: int, num_workers: int, num_replicas_in_sync: int = 1):
        super().__init__(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=num_replicas_in_sync
        )
        self._worker_index = int(worker_index)
        self._num_workers = int(num_workers)

    @property
    def worker_index(self) -> int:
        """This worker's index (an extension: shard with it, e.g. ``rows[worker_index::num_workers]``)."""
        return self._worker_index

    @property
    def num_workers(self) -> int:
        """The number of workers in the cluster (an extension)."""
        return self._num_workers

    def __repr__(self) -> str:
        return (
            "PerWorkerInputContext(num_input_pipelines=1, input_pipeline_id=0, "
            f"num_replicas_in_sync={self.num_replicas_in_sync}, worker_index={self._worker_index}, "
            f"num_workers={self._num_workers})"
        )


def _takes_argument(fn: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


class DatasetFnWithInputContext:
    """Wraps the user's ``dataset_fn``; on a worker, calls it with that worker's :class:`PerWorkerInputContext`
    (or with no argument if ``dataset_fn`` takes none)."""

    def __init__(self, dataset_fn: Callable[..., Iterable[object]]):
        self.dataset_fn = dataset_fn
        self.takes_context = _takes_argument(dataset_fn)

    def __call__(self, context: PerWorkerInputContext) -> Iterable[object]:
        return self.dataset_fn(context) if self.takes_context else self.dataset_fn()


class _Constant:
    """An iterable passed to ``create_per_worker_dataset`` instead of a function: every worker gets it as it is."""

    def __init__(self, value: Iterable[object]):
        self.value = value

    def __call__(self, context: PerWorkerInputContext) -> Iterable[object]:
        return self.value


def dataset_fn_for_workers(
        dataset_fn: Callable[..., Iterable[object]] | Iterable[object]
) -> Callable[[PerWorkerInputContext], Iterable[object]]:
    """What a worker calls with its :class:`PerWorkerInputContext` to build its dataset."""
    if callable(dataset_fn):
        return DatasetFnWithInputContext(dataset_fn)
    return _Constant(dataset_fn)


class DatasetBook(Protocol):
    """Where per-worker datasets and iterators are numbered (the chief's registry)."""

    def new_iterator(self, dataset_id: int) -> int:
        """A new iterator over dataset ``dataset_id``; returns its id."""
        ...


class PerWorkerDataset:
    """A dataset built by every worker from ``dataset_fn`` (``coordinator.create_per_worker_dataset``).

    ``iter(per_worker_dataset)`` gives a :class:`PerWorkerDatasetIterator`; pass it to a scheduled function
    (as an argument or through its closure) and call ``next(iterator)`` there: each worker draws from its own
    iterator, which keeps its position across closures.
    """

    def __init__(self, book: DatasetBook, did: int):
        self._book = book
        self._did = did

    def __iter__(self) -> PerWorkerDatasetIterator:
        return PerWorkerDatasetIterator(self._book, self._book.new_iterator(self._did))


class PerWorkerDatasetIterator(PerWorkerValues):
    """One iterator per worker (TF's per-worker iterator ``PerWorkerValues``)."""

    def __init__(self, book: DatasetBook, iid: int):
        super().__init__(())
        self._book = book
        self._iid = iid

    def __next__(self):
        raise RuntimeError("a per-worker iterator is advanced inside a scheduled function, on the worker: "
                           "coordinator.schedule(lambda it: next(it), args=(iterator,))")

    def __repr__(self) -> str:
        return f"PerWorkerDatasetIterator(id={self._iid})"
