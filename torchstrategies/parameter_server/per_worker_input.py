"""What a per-worker ``dataset_fn`` is told under ParameterServerStrategy.

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
from collections.abc import Callable
from typing import Any

from torchstrategies.distribute.input_lib import InputContext

__all__ = ["PerWorkerInputContext", "DatasetFnWithInputContext"]


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


def _takes_argument(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


class DatasetFnWithInputContext:
    """Wraps the user's ``dataset_fn``; on a worker, calls it with a :class:`PerWorkerInputContext`.

    The worker runtime calls this with its own context, whose ``num_input_pipelines`` is the number of
    workers and ``input_pipeline_id`` the worker's index; the user's function gets TF's context instead.
    """

    def __init__(self, dataset_fn: Callable[..., Any]):
        self.dataset_fn = dataset_fn
        self.takes_context = _takes_argument(dataset_fn)

    def __call__(self, worker_context: Any) -> Any:
        if not self.takes_context:
            return self.dataset_fn()
        ctx = PerWorkerInputContext(
            worker_index=worker_context.input_pipeline_id,
            num_workers=worker_context.num_input_pipelines,
            num_replicas_in_sync=getattr(worker_context, "num_replicas_in_sync", 1),
        )
        return self.dataset_fn(ctx)
