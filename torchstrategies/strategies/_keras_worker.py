"""A Keras model under MultiWorkerMirroredStrategy (``_keras.py``): this process is one replica; it keeps its
rows of the global batch, and metrics and non-trainable floats are made global after each step; only the
chief's ``ModelCheckpoint`` writes where it was told."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from torchstrategies.distribute.distribute_lib import ReplicaContext
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies import _keras_api as keras_api
from torchstrategies.strategies._keras_api import KerasModel, KerasVariable
from torchstrategies.strategies._keras_replicas import Communicator, KerasReplicas

if TYPE_CHECKING:
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended

__all__ = ["KerasWorker"]


class _WorkerCommunicator:
    """Sums over the workers of a MultiWorkerMirrored strategy (one replica each)."""

    def __init__(self, extended: MultiWorkerMirroredExtended) -> None:
        self._extended = extended

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        (out,) = self._extended.all_reduce_tensors(ReduceOp.SUM, [t])
        return out


class KerasWorker(KerasReplicas):
    """MultiWorkerMirrored: this process is one replica; it keeps its rows, and metrics and non-trainable
    floats are made global after each step."""

    def __init__(self, extended: MultiWorkerMirroredExtended, model: KerasModel) -> None:
        super().__init__(extended, model)
        self.extended: MultiWorkerMirroredExtended = extended
        self._weights_seen = _count_weights(model)  # the strategy adopts these right after attach

    def _adopt_new_weights(self) -> None:
        """Weights the model made after the scope (a subclassed model builds at its first batch, in
        ``fit``) are adopted before the step as if made in it: rank 0's values broadcast, gradients
        synchronized (``_on_module_created`` is idempotent per parameter)."""
        count = _count_weights(self.model)
        if count != self._weights_seen:
            self.extended._on_module_created(cast(torch.nn.Module, self.model))
            self._weights_seen = count

    def replica_id(self) -> int:
        return int(self.extended.rank)

    def _replica(self) -> ReplicaContext:
        """The replica context Keras' step runs in, as in ``strategy.run`` on this worker (TF runs Keras'
        step in ``strategy.run``): ``replica_id_in_sync_group`` is this worker's rank."""
        return ReplicaContext(self.extended._container_strategy(), self.replica_id(), 0)

    def communicator(self) -> Communicator:
        return _WorkerCommunicator(self.extended)

    def _same_shuffle(self) -> None:
        """Every worker starts ``fit`` from rank 0's torch random state, so ``shuffle=True`` (Keras'
        default: a torch RandomSampler) gives the same global batches on every worker."""
        state = torch.get_rng_state().to(torch.int64)
        self.extended.broadcast_tensors([state], src=0)
        torch.set_rng_state(state.to(torch.uint8))

    def _metric_variables(self) -> list[KerasVariable]:
        return [v for v in self.model.metrics_variables if _is_float(v.value)]

    def _globalize_metrics(self, before: list[torch.Tensor], variables: Sequence[KerasVariable]) -> None:
        sums = [(v, b) for v, b in zip(variables, before) if v.aggregation == "sum"]
        means = [v for v in variables if v.aggregation == "mean"]
        if sums:
            deltas = self.extended.all_reduce_tensors(ReduceOp.SUM, [v.value.detach() - b for v, b in sums])
            for (v, b), d in zip(sums, deltas):
                v.assign(b + d.to(b.device))
        if means:
            for v, m in zip(means, self.extended.all_reduce_tensors(ReduceOp.MEAN, [v.value.detach() for v in means])):
                v.assign(m.to(v.value.device))

    @contextlib.contextmanager
    def _global_metrics(self) -> Iterator[None]:
        variables = self._metric_variables()
        before = [v.value.detach().clone() for v in variables]
        yield
        self._globalize_metrics(before, variables)

    def _mean_non_trainable(self) -> None:
        floats = [v for v in self.model.non_trainable_variables if _is_float(v.value)]
        if floats:
            means = self.extended.all_reduce_tensors(ReduceOp.MEAN, [v.value.detach() for v in floats])
            for v, m in zip(floats, means):
                v.assign(m.to(v.value.device))

    def train(self, data: Any) -> Any:
        self._adopt_new_weights()
        shards, _ = self.split(data)
        try:
            with self._global_metrics(), self._replica_loss(train=True), self._replica():
                logs = self.train_step(shards[self.replica_id()])
        finally:
            self.rows = None
        self._mean_non_trainable()
        return _with_global(logs, self.model)

    def test(self, data: Any) -> Any:
        self._adopt_new_weights()
        shards, _ = self.split(data)
        self.rows = None
        with self._global_metrics(), self._replica_loss(train=False), self._replica():
            logs = self.test_step(shards[self.replica_id()])
        return _with_global(logs, self.model)

    def fit_(self, *args: Any, **kwargs: Any) -> Any:
        self._same_shuffle()
        if self.extended.should_checkpoint:
            return self.fit(*args, **kwargs)
        callbacks = kwargs.get("callbacks") or []
        moved = []
        scratch = tempfile.mkdtemp(prefix=f"torchstrategies_keras_worker{self.replica_id()}_")
        try:
            for cb in callbacks:
                writer = keras_api.model_checkpoint(cb)
                if writer is not None:
                    moved.append((writer, writer.filepath))
                    writer.filepath = os.path.join(scratch, os.path.basename(str(writer.filepath)))
            return self.fit(*args, **kwargs)
        finally:
            for cb, path in moved:
                cb.filepath = path
            shutil.rmtree(scratch, ignore_errors=True)


def _count_weights(model: KerasModel) -> int:
    return sum(1 for _ in model.parameters())


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _with_global(logs: Any, model: KerasModel) -> Any:
    """The step's logs with every metric replaced by its (now global) result."""
    if not isinstance(logs, dict):
        return logs
    return {**logs, **model.get_metrics_result()}
