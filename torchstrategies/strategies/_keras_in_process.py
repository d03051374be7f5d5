"""A Keras model under an in-process strategy, Mirrored or CentralStorage (``_keras.py``): Keras' step runs
once per replica in ``strategy.run``, the Keras optimizer's ``apply`` is a merge_call, and the replicas
draw the same random numbers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchstrategies.distribute import context as ts_context
from torchstrategies.distribute.distribute_lib import ReplicaContext, StrategyExtended
from torchstrategies.distribute.values import PerReplica
from torchstrategies.strategies import _keras_api as keras_api
from torchstrategies.strategies._keras_api import KerasModel, KerasVariable, RandomLayer
from torchstrategies.strategies._keras_replicas import Communicator, KerasReplicas

__all__ = ["KerasInProcess"]


class KerasInProcess(KerasReplicas):
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

    def communicator(self) -> Communicator:
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
            with self._replica_loss(train=True), self._merged_apply():
                strategy.run(self.train_step, args=(PerReplica(tuple(shards)),))
        finally:
            self.rows = None
        return self.model.get_metrics_result()

    def test(self, data: Any) -> Any:
        shards, _ = self.split(data)
        self.rows = None
        with self._replica_loss(train=False):
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
