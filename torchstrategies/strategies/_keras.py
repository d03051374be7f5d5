"""Keras 3 (torch backend) ``fit`` / ``evaluate`` / ``predict`` under MultiWorkerMirrored, Mirrored and
CentralStorage strategies, as under tf.distribute.

A Keras model made in the scope is a ``torch.nn.Module`` whose variables are ``nn.Parameter``s, so the
strategy adopts it like any module (MWMS: rank 0's weights broadcast, trainable ones in the gradient
synchronizer; in-process: replicated), and Keras' own ``loss.backward()`` leaves in every ``.grad`` the
cross-replica sum: the one gradient path of docs/strategies.md, nothing reduced twice. This module adds
only what Keras' loop needs on top, as instance attributes of the model (its class is untouched):

* ``train_step`` / ``test_step`` receive the GLOBAL batch (every worker passes the same full data and
  ``batch_size`` is global, as under tf.distribute) and split it over the replicas, evenly, larger parts
  first (TF's rule for a partial batch). MWMS: this process runs Keras' step on its rows. In-process:
  ``strategy.run`` runs Keras' step once per replica on its rows, and the Keras optimizer's ``apply`` is a
  merge_call (one update in cross-replica context from the summed gradients, copied to every replica).
* The gradient of ``model.compute_loss`` is scaled by ``replica rows / global rows`` (where TF's Keras
  scales the loss for tf.distribute), so the summed gradient is the gradient of the global mean:
  ``1/num_replicas`` for an even split, as TF's Keras scales, and exact for an uneven final batch. Keras'
  own step and a custom ``train_step`` written as in Keras' guide (``compute_loss``, ``loss.backward()``,
  ``optimizer.apply``) both call it; a step that applies gradients without it raises.
* Metrics are global. MWMS: after each step a metric variable with aggregation ``"sum"`` (Keras' default
  for metric state: totals, counts) becomes its value before the step plus the cross-worker sum of what
  each worker added, ``"mean"`` ones the cross-worker mean. In-process: the replicas run one at a time on
  the model's one set of metric variables, so they add up every replica's rows. So ``history``,
  ``evaluate()`` and what callbacks see are the job's values, on every worker.
* In a train step a ``BatchNormalization`` layer normalizes with the statistics of the GLOBAL batch (one
  differentiable all-reduce of the per-channel sums, as ``ts.nn.SyncBatchNorm``), so N replicas train as
  one process with the global batch (TF's Keras uses per-replica statistics unless ``synchronized=True``,
  which Keras 3 refuses on torch). MWMS also averages floating non-trainable variables across the
  workers after each step (the buffer rule: equal on every rank between steps).
* A layer that draws random numbers (it has a ``seed_generator``: Dropout, GaussianNoise, random
  augmentation) draws them for the whole global batch, zero-padded around the replica's rows, and keeps
  its rows: the masks of one process; in-process replicas start their draw from the same random state.
* ``predict_step`` runs the whole batch (no communication): every worker gets every prediction.
* MWMS ``fit`` on a worker other than the chief gives each ``ModelCheckpoint`` a temporary directory,
  removed after ``fit`` (TF's rule: the chief writes, the others write somewhere harmless).

Keras is never imported here, and never touched directly: every attribute this module reads or replaces
on a Keras object is named and typed in ``strategies/_keras_api.py`` (the adapter), which checks it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from torchstrategies.distribute import context as ts_context
from torchstrategies.distribute.distribute_lib import ReplicaContext, StrategyExtended
from torchstrategies.distribute.values import PerReplica
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies import _keras_api as keras_api
from torchstrategies.strategies._keras_api import BatchNormLayer, KerasModel, KerasVariable, RandomLayer

if TYPE_CHECKING:
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended

__all__ = ["attach", "is_keras_model", "split_rows"]

_ATTACHED = "_torchstrategies_keras"


def is_keras_model(module: torch.nn.Module) -> bool:
    """Whether the Keras 3 layer ``module`` is a model (it has Keras' training loop; checked by the adapter)."""
    return keras_api.as_model(module) is not None


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


class _Communicator(Protocol):
    """Sums a tensor over the replicas (the workers, or this process's replicas)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...


class _AllReduceSum(torch.autograd.Function):
    """A SUM all-reduce over the replicas whose gradient is the SUM all-reduce of the gradients (every
    replica's loss depends on the sum)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: _Communicator) -> torch.Tensor:  # type: ignore[override]
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


class _WorkerCommunicator:
    """Sums over the workers of a MultiWorkerMirrored strategy (one replica each)."""

    def __init__(self, extended: MultiWorkerMirroredExtended) -> None:
        self._extended = extended

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        (out,) = self._extended.all_reduce_tensors(ReduceOp.SUM, [t])
        return out


class _KerasReplicas:
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

    def communicator(self) -> _Communicator:
        raise NotImplementedError

    def split(self, data: Any) -> tuple[list[Any], int]:
        """Every replica's rows of the global batch ``data`` (``self.rows`` set) and the global row count."""
        n = _batch_rows(data)
        replicas = int(self.extended._num_replicas_in_sync)
        parts = [split_rows(n, replicas, r) for r in range(replicas)]
        if any(stop == start for start, stop in parts):
            raise ValueError(
                f"A global batch of {n} rows can not be split over {replicas} replicas (one would get no rows): "
                "make batch_size and the last batch at least the number of replicas")
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
    def _scaled_loss(self) -> Iterator[None]:
        """In a train step, ``model.compute_loss`` (what Keras' own step and a ``train_step`` written as in
        Keras' guide call) returns the replica's loss with its gradient scaled by the replica's rows / the
        global rows, so the replicas' summed gradient is the global batch's, as TF's Keras scales the loss
        under tf.distribute (``scale_loss_for_distribution``, in the loss). The value is the replica's own
        loss, so Keras' loss tracker and a custom step's metrics read it as one process does. A step that
        applied gradients without calling ``compute_loss`` raises (they would be summed unscaled)."""
        model = keras_api.compiled(self.model)
        optimizer = model.optimizer
        compute_loss = model.compute_loss  # the class's (a subclass may override it)
        calls: list[int] = []

        def scaled(*args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(*args, **kwargs)
            assert self.rows is not None
            start, stop, n = self.rows[self.replica_id()]
            calls.append(1)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return loss
            return _ScaleGradient.apply(loss, (stop - start) / n)

        steps = keras_api.iterations(optimizer)
        keras_api.override(model, "compute_loss", scaled)
        try:
            yield
        finally:
            keras_api.remove_override(model, "compute_loss")
        if not calls and keras_api.iterations(optimizer) != steps:
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


class _KerasWorker(_KerasReplicas):
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

    def communicator(self) -> _Communicator:
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
            with self._global_metrics(), self._scaled_loss(), self._replica():
                logs = self.train_step(shards[self.replica_id()])
        finally:
            self.rows = None
        self._mean_non_trainable()
        return _with_global(logs, self.model)

    def test(self, data: Any) -> Any:
        self._adopt_new_weights()
        shards, _ = self.split(data)
        self.rows = None
        with self._global_metrics(), self._replica():
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


class _KerasInProcess(_KerasReplicas):
    """Mirrored / CentralStorage: Keras' own step runs once per replica in ``strategy.run`` on the
    replica's rows; backward sums the gradients (the in-process gradient rule) and the Keras optimizer's
    ``apply`` is a merge_call, so it updates once, in cross-replica context, from the summed gradients, and
    the strategy copies the update to every replica's weights. The replicas run one at a time on the
    model's one set of metric variables, so the metrics add up every replica's rows (the global values)."""

    def __init__(self, extended: StrategyExtended, model: KerasModel) -> None:
        super().__init__(extended, model)
        self._draws: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def replica_id(self) -> int:
        return _replica_context().replica_id_in_sync_group

    def communicator(self) -> _Communicator:
        from torchstrategies.nn.sync_batchnorm import _ReplicaCommunicator

        return _ReplicaCommunicator(_replica_context())

    @contextlib.contextmanager
    def _same_draw(self, layer: RandomLayer, device: torch.device) -> Iterator[None]:
        """The replicas share this process's random state and run one at a time: replica 0 records the
        state (torch's generator of the device, the layer's seed) before its draw, the others start from
        it, so every replica draws the global batch's numbers, and the state after the step is one draw's."""
        seed = layer.seed_generator.state
        if self.replica_id() == 0:
            self._draws[id(layer)] = (_rng_state(device), seed.value.detach().clone())
        else:
            rng, state = self._draws[id(layer)]
            _set_rng_state(device, rng)
            seed.assign(state)
        yield

    @contextlib.contextmanager
    def _merged_apply(self) -> Iterator[None]:
        optimizer = keras_api.compiled(self.model).optimizer
        if optimizer is None:  # nothing applies gradients
            yield
            return
        apply = optimizer.apply

        def merged(grads: Sequence[torch.Tensor | None],
                   trainable_variables: Sequence[KerasVariable] | None = None) -> object:
            variables = list(trainable_variables if trainable_variables is not None
                             else self.model.trainable_variables)

            def update(strategy: object) -> object:  # cross-replica: .grad is the replicas' sum
                return apply([v.value.grad for v in variables], variables)

            return _replica_context().merge_call(update)

        keras_api.override(optimizer, "apply", merged)
        try:
            yield
        finally:
            keras_api.remove_override(optimizer, "apply")

    def train(self, data: Any) -> Any:
        shards, _ = self.split(data)
        strategy = self.extended._container_strategy()
        try:
            with self._scaled_loss(), self._merged_apply():
                strategy.run(self.train_step, args=(PerReplica(tuple(shards)),))
        finally:
            self.rows = None
        return self.model.get_metrics_result()

    def test(self, data: Any) -> Any:
        shards, _ = self.split(data)
        self.rows = None
        self.extended._container_strategy().run(self.test_step, args=(PerReplica(tuple(shards)),))
        return self.model.get_metrics_result()


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _replica_context() -> ReplicaContext:
    rc = ts_context.get_replica_context()
    if rc is None:
        raise RuntimeError("Keras' train step of a model under an in-process strategy ran outside strategy.run")
    return rc


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


def _count_weights(model: KerasModel) -> int:
    return sum(1 for _ in model.parameters())


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _with_global(logs: Any, model: KerasModel) -> Any:
    """The step's logs with every metric replaced by its (now global) result."""
    if not isinstance(logs, dict):
        return logs
    return {**logs, **model.get_metrics_result()}


def attach(extended: StrategyExtended, module: torch.nn.Module, in_process: bool) -> None:
    """Makes ``model.fit`` / ``evaluate`` / ``predict`` train as one model over every replica of
    ``extended``: a MultiWorkerMirrored strategy's (``in_process=False``) or a Mirrored /
    CentralStorage one's (``in_process=True``). Idempotent."""
    model = keras_api.as_model(module)
    if model is None:
        raise TypeError(f"attach: {type(module).__name__} is not a Keras model (it has no train_step and fit)")
    if getattr(model, _ATTACHED, None) is not None:
        return
    if model.jit_compile is True:
        raise NotImplementedError(_JIT)
    worker: _KerasReplicas
    if in_process:
        worker = _KerasInProcess(extended, model)
    else:
        worker = _KerasWorker(cast("MultiWorkerMirroredExtended", extended), model)
    overrides: list[tuple[keras_api.Overridden, object]] = [
        ("train_step", worker.train), ("test_step", worker.test), ("fit", worker.fit_), ("compile", _compile(model)),
        ("_torchstrategies_keras", worker)]
    for name, fn in overrides:
        keras_api.override(model, name, fn)


_JIT = ("jit_compile=True is not supported for a Keras model under a torchstrategies strategy (torch.compile of "
        "Keras' train step would trace the split of the batch and the replicas' communication): compile the "
        "model with jit_compile=False (Keras' default on the torch backend)")


def _compile(model: KerasModel) -> Callable[..., Any]:
    compile_ = model.compile

    def compile(*args: Any, **kwargs: Any) -> Any:
        out = compile_(*args, **kwargs)
        if model.jit_compile is True:
            raise NotImplementedError(_JIT)
        return out

    return compile
