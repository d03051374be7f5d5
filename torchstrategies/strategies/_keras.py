"""Keras 3 (torch backend) ``fit`` / ``evaluate`` / ``predict`` under MultiWorkerMirroredStrategy.

A Keras model made in the scope is a ``torch.nn.Module`` whose variables are ``nn.Parameter``s, so the
strategy adopts it like any module: rank 0's weights are broadcast and its trainable parameters join the
gradient synchronizer, so after Keras' own ``loss.backward()`` every ``.grad`` is the cross-worker sum (the
one gradient path of docs/strategies.md, nothing reduced twice). This module adds only what Keras' loop
needs on top, as instance attributes of the model (its class is untouched):

* ``train_step`` / ``test_step`` receive the GLOBAL batch (every worker passes the same full data and
  ``batch_size`` is global, as under tf.distribute) and keep this worker's rows: the batch is split evenly
  over the workers, larger parts first (TF's rule for a partial batch).
* The loss is scaled by ``local rows / global rows`` before backward (``optimizer.scale_loss``, Keras' own
  seam), so the summed gradient is the gradient of the global mean: ``1/num_workers`` for an even split,
  as TF's Keras scales, and exact for an uneven final batch.
* After each step the metric variables are made global: a variable with aggregation ``"sum"`` (Keras'
  default for metric state: totals, counts) becomes its value before the step plus the cross-worker sum of
  what each worker added; ``"mean"`` ones the cross-worker mean. So ``history``, ``evaluate()`` and what
  callbacks see are the job's values, on every worker.
* Floating non-trainable variables of the model (BatchNormalization's moving statistics) become their
  cross-worker mean after each train step (the one buffer rule: equal on every rank between steps).
* In a train step a ``BatchNormalization`` layer normalizes with the statistics of the GLOBAL batch (one
  differentiable all-reduce of the per-channel sums, as ``ts.nn.SyncBatchNorm``), so N workers train as
  one process with the global batch (TF's Keras uses per-replica statistics unless ``synchronized=True``,
  which Keras 3 refuses on torch). A layer that draws random numbers (it has a ``seed_generator``:
  Dropout, GaussianNoise, random augmentation) draws them for the whole global batch, zero-padded around
  this worker's rows, and keeps its rows: the same masks as one process, and the seed state stays equal
  on every worker.
* ``predict_step`` runs the whole batch on every worker (no communication; every worker gets every
  prediction).
* ``fit`` on a worker other than the chief gives each ``ModelCheckpoint`` a temporary directory, removed
  after ``fit`` (TF's rule: the chief writes, the others write somewhere harmless).

Keras is never imported here: the model is reached only through the object handed in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchstrategies.reduce_op import ReduceOp

__all__ = ["attach", "is_keras_model", "split_rows"]

_ATTACHED = "_torchstrategies_keras"


def is_keras_model(module: torch.nn.Module) -> bool:
    """Whether the Keras 3 layer ``module`` is a model (it has Keras' training loop)."""
    return callable(getattr(module, "train_step", None)) and callable(getattr(module, "fit", None))


def split_rows(n: int, workers: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` rows of a global batch of ``n`` rows that worker ``rank`` of ``workers`` keeps:
    an even split, the larger parts first (TF's rule for a partial batch)."""
    base, extra = divmod(n, workers)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _shard(data: Any, rank: int, workers: int) -> tuple[Any, int, int]:
    """This worker's rows of every tensor in the nested batch ``data``; also its and the global row count."""
    sizes = {t.shape[0] for t in _leaves(data) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"A Keras batch under MultiWorkerMirroredStrategy must have one batch size, got {sizes}")
    (n,) = sizes
    start, stop = split_rows(n, workers, rank)
    if stop == start:
        raise ValueError(
            f"A global batch of {n} rows can not be split over {workers} workers (worker {rank} would get no "
            "rows): make batch_size and the last batch at least the number of workers")
    return _map(lambda t: t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, data), stop - start, n


def _leaves(data: Any) -> list[Any]:
    if isinstance(data, (tuple, list)):
        return [x for d in data for x in _leaves(d)]
    if isinstance(data, dict):
        return [x for d in data.values() for x in _leaves(d)]
    return [data]


def _map(fn: Callable[[Any], Any], data: Any) -> Any:
    if isinstance(data, (tuple, list)):
        return type(data)(_map(fn, d) for d in data)
    if isinstance(data, dict):
        return {k: _map(fn, v) for k, v in data.items()}
    return fn(data)


class _AllReduceSum(torch.autograd.Function):
    """A SUM all-reduce over the workers whose gradient is the SUM all-reduce of the gradients (every
    worker's loss depends on the sum)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, extended: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.extended = extended
        (out,) = extended.all_reduce_tensors(ReduceOp.SUM, [t.detach()])
        return out.to(t.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (out,) = ctx.extended.all_reduce_tensors(ReduceOp.SUM, [grad.contiguous()])
        return out.to(grad.device), None


class _KerasWorker:
    """The per-model state: the strategy's extended object and the model's original step functions."""

    def __init__(self, extended: Any, model: Any) -> None:
        self.extended = extended
        self.model = model
        self.train_step = model.train_step
        self.test_step = model.test_step
        self.fit = model.fit
        self.rows: tuple[int, int, int] | None = None  # (start, stop, global rows) inside a train step
        for layer in model._flatten_layers(include_self=False, recursive=True):
            if _is_batch_norm(layer):
                object.__setattr__(layer, "_moments", self._global_moments(layer))
            elif getattr(layer, "seed_generator", None) is not None:
                object.__setattr__(layer, "call", self._global_randomness(layer.call))

    def _global_moments(self, layer: Any) -> Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]:
        local = layer._moments

        def moments(inputs: torch.Tensor, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self.rows is None:
                return local(inputs, mask)  # a forward pass outside fit: this worker's batch
            if mask is not None:
                raise NotImplementedError(
                    f"A masked BatchNormalization ({layer.name}) under MultiWorkerMirroredStrategy is not "
                    "supported: its global statistics are computed only without a mask")
            axes = list(layer._reduction_axes)
            s1, s2 = inputs.sum(dim=axes), torch.square(inputs).sum(dim=axes)
            count = torch.tensor([inputs.numel() / max(s1.numel(), 1)], dtype=inputs.dtype, device=inputs.device)
            total = _AllReduceSum.apply(torch.cat([s1.reshape(-1), s2.reshape(-1), count]), self.extended)
            c = s1.numel()
            n = total[2 * c].detach()
            mean = (total[:c] / n).reshape(s1.shape)
            return mean, (total[c:2 * c] / n).reshape(s1.shape) - torch.square(mean)

        return moments

    def _global_randomness(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def call_(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self.rows is None or not isinstance(inputs, torch.Tensor):
                return call(inputs, *args, **kwargs)
            start, stop, n = self.rows
            pad = [inputs.new_zeros((k, *inputs.shape[1:])) for k in (start, n - stop)]
            return call(torch.cat([pad[0], inputs, pad[1]]), *args, **kwargs)[start:stop]

        return call_

    @property
    def rank(self) -> int:
        return int(self.extended.rank)

    @property
    def workers(self) -> int:
        return int(self.extended.world_size)

    def _metric_variables(self) -> list[Any]:
        return [v for v in self.model.metrics_variables if _is_float(v.value)]

    def _globalize_metrics(self, before: list[torch.Tensor], variables: list[Any]) -> None:
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

    @contextlib.contextmanager
    def _scaled_loss(self, factor: float) -> Iterator[None]:
        optimizer = self.model.optimizer
        if optimizer is None:
            yield
            return
        scale = optimizer.scale_loss  # the class's, or a LossScaleOptimizer's
        object.__setattr__(optimizer, "scale_loss", lambda loss: scale(loss) * factor)
        try:
            yield
        finally:
            object.__delattr__(optimizer, "scale_loss")

    def _mean_non_trainable(self) -> None:
        floats = [v for v in self.model.non_trainable_variables if _is_float(v.value)]
        if floats:
            means = self.extended.all_reduce_tensors(ReduceOp.MEAN, [v.value.detach() for v in floats])
            for v, m in zip(floats, means):
                v.assign(m.to(v.value.device))

    def train(self, data: Any) -> Any:
        local, rows, total = _shard(data, self.rank, self.workers)
        start, _ = split_rows(total, self.workers, self.rank)
        self.rows = (start, start + rows, total)
        try:
            with self._global_metrics(), self._scaled_loss(rows / total):
                logs = self.train_step(local)
        finally:
            self.rows = None
        self._mean_non_trainable()
        return _with_global(logs, self.model)

    def test(self, data: Any) -> Any:
        local, _, _ = _shard(data, self.rank, self.workers)
        with self._global_metrics():
            logs = self.test_step(local)
        return _with_global(logs, self.model)

    def fit_(self, *args: Any, **kwargs: Any) -> Any:
        if self.extended.should_checkpoint:
            return self.fit(*args, **kwargs)
        callbacks = kwargs.get("callbacks") or []
        moved = []
        scratch = tempfile.mkdtemp(prefix=f"torchstrategies_keras_worker{self.rank}_")
        try:
            for cb in callbacks:
                if any(c.__name__ == "ModelCheckpoint" for c in type(cb).__mro__):
                    moved.append((cb, cb.filepath))
                    cb.filepath = os.path.join(scratch, os.path.basename(str(cb.filepath)))
            return self.fit(*args, **kwargs)
        finally:
            for cb, path in moved:
                cb.filepath = path
            shutil.rmtree(scratch, ignore_errors=True)


def _is_batch_norm(layer: Any) -> bool:
    return any(c.__name__ == "BatchNormalization" for c in type(layer).__mro__) and hasattr(layer, "_moments")


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _with_global(logs: Any, model: Any) -> Any:
    """The step's logs with every metric replaced by its (now global) result."""
    if not isinstance(logs, dict):
        return logs
    return {**logs, **model.get_metrics_result()}


def attach(extended: Any, model: Any) -> None:
    """Makes ``model.fit`` / ``evaluate`` / ``predict`` train as one model over every worker of
    ``extended`` (a MultiWorkerMirrored strategy's extended object). Idempotent."""
    if getattr(model, _ATTACHED, None) is not None:
        return
    if getattr(model, "jit_compile", False) is True:
        raise NotImplementedError(_JIT)
    worker = _KerasWorker(extended, model)
    for name, fn in (("train_step", worker.train), ("test_step", worker.test), ("fit", worker.fit_),
                     ("compile", _compile(model)), (_ATTACHED, worker)):
        object.__setattr__(model, name, fn)


_JIT = ("jit_compile=True is not supported for a Keras model under MultiWorkerMirroredStrategy (torch.compile "
        "of Keras' train step would trace the split of the batch and the metric all-reduce): compile the model "
        "with jit_compile=False (Keras' default on the torch backend)")


def _compile(model: Any) -> Callable[..., Any]:
    compile_ = model.compile

    def compile(*args: Any, **kwargs: Any) -> Any:
        out = compile_(*args, **kwargs)
        if model.jit_compile is True:
            raise NotImplementedError(_JIT)
        return out

    return compile
