"""What a Keras model's replicas share under every strategy (``_keras.py`` says what Keras' loop gets): the
model's original step functions, the split of a global batch over the replicas, the loss scale, and the
layers that see the global batch (BatchNormalization's statistics, random layers' draws). Subclasses
(``_keras_worker.py``, ``_keras_in_process.py``) say how a step runs over the replicas and how they
communicate."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from torchstrategies.distribute.distribute_lib import StrategyExtended
from torchstrategies.strategies import _keras_api as keras_api
from torchstrategies.strategies._keras_api import BatchNormLayer, KerasModel, RandomLayer

__all__ = ["Communicator", "KerasReplicas", "split_rows"]


def split_rows(n: int, workers: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` rows of a global batch of ``n`` rows that worker ``rank`` of ``workers`` keeps:
    an even split, the larger parts first (TF's rule for a partial batch)."""
    base, extra = divmod(n, workers)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


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


class Communicator(Protocol):
    """Sums a tensor over the replicas (the workers, or this process's replicas)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...


class _AllReduceSum(torch.autograd.Function):
    """A SUM all-reduce over the replicas whose gradient is the SUM all-reduce of the gradients (every
    replica's loss depends on the sum)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return comm.all_reduce_sum(t.detach()).to(t.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return ctx.comm.all_reduce_sum(grad.contiguous()).to(grad.device), None


class _ScaleGradient(torch.autograd.Function):
    """The identity whose gradient is multiplied by ``scale`` (a replica's share of the global batch)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.scale, None


class KerasReplicas:
    """What both kinds of strategy share: the model's original step functions, the split of a global
    batch, the loss scale, and the layers that see the global batch (BatchNormalization, random layers).
    Subclasses say how a step runs over the replicas and how they communicate."""

    def __init__(self, extended: StrategyExtended, model: KerasModel) -> None:
        self.extended = extended
        self.model = model
        self.train_step = model.train_step
        self.test_step = model.test_step
        self.fit = model.fit
        self.rows: dict[int, tuple[int, int, int]] | None = None  # replica -> (start, stop, n) in a train step
        for layer in keras_api.layers(model):
            bn = keras_api.batch_norm(layer)
            random = keras_api.random_layer(layer) if bn is None else None
            if bn is not None:
                keras_api.override(bn, "_moments", self._global_moments(bn))
            elif random is not None:
                keras_api.override(random, "call", self._global_randomness(random, random.call))

    def replica_id(self) -> int:
        raise NotImplementedError

    def communicator(self) -> Communicator:
        raise NotImplementedError

    def split(self, data: Any) -> tuple[list[Any], int]:
        """Every replica's rows of the global batch ``data`` (``self.rows`` set) and the global row count."""
        n = _batch_rows(data)
        replicas = int(self.extended._num_replicas_in_sync)
        parts = [split_rows(n, replicas, r) for r in range(replicas)]
        self.rows = {r: (start, stop, n) for r, (start, stop) in enumerate(parts)}
        return [_map(functools.partial(_rows, start=start, stop=stop), data) for start, stop in parts], n

    def _global_moments(self, layer: BatchNormLayer
                        ) -> Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]:
        local = layer._moments

        def moments(inputs: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            if self.rows is None:
                return local(inputs, mask)  # a forward pass outside fit: this replica's batch
            if mask is not None:
                raise NotImplementedError(
                    f"A masked BatchNormalization ({layer.name}) under {type(self.extended).__name__} is not "
                    "supported: its global statistics are computed only without a mask")
            axes = list(layer._reduction_axes)
            s1, s2 = inputs.sum(dim=axes), torch.square(inputs).sum(dim=axes)
            count = torch.tensor([inputs.numel() / max(s1.numel(), 1)], dtype=inputs.dtype, device=inputs.device)
            total = _AllReduceSum.apply(torch.cat([s1.reshape(-1), s2.reshape(-1), count]), self.communicator())
            c = s1.numel()
            n = total[2 * c].detach()
            mean = (total[:c] / n).reshape(s1.shape)
            return mean, (total[c:2 * c] / n).reshape(s1.shape) - torch.square(mean)

        return moments

    def _global_randomness(self, layer: RandomLayer, call: Callable[..., Any]) -> Callable[..., Any]:
        def call_(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self.rows is None or not isinstance(inputs, torch.Tensor):
                return call(inputs, *args, **kwargs)
            start, stop, n = self.rows[self.replica_id()]
            pad = [inputs.new_zeros((k, *inputs.shape[1:])) for k in (start, n - stop)]
            with self._same_draw(layer, inputs.device):
                return call(torch.cat([pad[0], inputs, pad[1]]), *args, **kwargs)[start:stop]

        return call_

    @contextlib.contextmanager
    def _same_draw(self, layer: RandomLayer, device: torch.device) -> Iterator[None]:
        """Every replica of this process draws the same random numbers (a process's replicas share its
        random state). One replica per process: nothing to do."""
        yield

    @contextlib.contextmanager
    def _replica_loss(self, train: bool) -> Iterator[None]:
        """Inside, ``model.compute_loss`` (what Keras' own steps and a ``train_step`` written as in Keras' guide
        call) returns the replica's loss as one process would for the replica's rows, with two changes:

        * A replica with no rows (a global batch with fewer rows than replicas, e.g. the last one) gets 0, where
          Keras gives an empty tensor (``reduce_values`` returns the values of an empty batch as they are);
          Keras' loss tracker weighs it by the replica's 0 rows, so the global loss is the other replicas'.
        * In a train step (``train``), its gradient is scaled by the replica's rows / the global rows, so the
          replicas' summed gradient is the global batch's, as TF's Keras scales the loss under tf.distribute
          (``scale_loss_for_distribution``, in the loss). The value stays the replica's own loss, so Keras'
          loss tracker and a custom step's metrics read it as one process does. A train step that applied
          gradients without calling ``compute_loss`` raises (they would be summed unscaled)."""
        model = keras_api.compiled(self.model)
        optimizer = model.optimizer
        compute_loss = model.compute_loss  # the class's (a subclass may override it)
        calls: list[int] = []

        def replica_loss(*args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(*args, **kwargs)
            calls.append(1)
            if not isinstance(loss, torch.Tensor):
                return loss
            if loss.numel() == 0:  # no rows: adds nothing to the global batch's loss or gradient
                loss = loss.sum()
            if not train or not loss.requires_grad:
                return loss
            assert self.rows is not None
            start, stop, n = self.rows[self.replica_id()]
            return _ScaleGradient.apply(loss, (stop - start) / n)

        steps = keras_api.iterations(optimizer) if train else None
        keras_api.override(model, "compute_loss", replica_loss)
        try:
            yield
        finally:
            keras_api.remove_override(model, "compute_loss")
        if train and not calls and keras_api.iterations(optimizer) != steps:
            raise RuntimeError(
                f"The train step of {type(model).__name__} applied gradients of a loss that model.compute_loss did "
                f"not compute, under {type(self.extended._container_strategy()).__name__} with "
                f"{self.extended._num_replicas_in_sync} replicas: each replica's gradient is of its own rows' "
                "mean, and their sum would train at that many times the learning rate. Compute the loss with "
                "self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight) (as Keras' guide to a "
                "custom train_step does; it scales each replica's gradient by its share of the global batch, "
                "as TF's Keras scales the loss under tf.distribute)")

    def fit_(self, *args: Any, **kwargs: Any) -> Any:
        return self.fit(*args, **kwargs)


def _batched(t: Any) -> bool:
    """A leaf of a batch that has rows: a tensor or an array (``train_on_batch`` hands Keras' step numpy)."""
    return isinstance(getattr(t, "ndim", None), int) and t.ndim > 0 and hasattr(t, "shape")


def _batch_rows(data: Any) -> int:
    sizes = {int(t.shape[0]) for t in _leaves(data) if _batched(t)}
    if len(sizes) != 1:
        raise ValueError(f"A Keras batch under a strategy must have one batch size, got {sorted(sizes)}")
    return int(sizes.pop())


def _rows(t: Any, start: int, stop: int) -> Any:
    return t[start:stop] if _batched(t) else t
