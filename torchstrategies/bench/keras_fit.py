"""Keras 3 rows of ``bench train`` (issue 37): Keras under MultiWorkerMirroredStrategy against plain Keras
in one process, in the same torchrun job.

* ``keras-mwms``: the benchmark MLP as a Keras model made in a ``MultiWorkerMirroredStrategy`` scope; each
  step is ``model.train_on_batch`` of the GLOBAL batch (every rank its rows, the strategy's Keras support
  splits it), as ``fit`` runs it;
* ``keras-one-process``: the same model in plain Keras on rank 0, one ``train_on_batch`` of the same
  global batch per step (the other ranks wait at the step's barrier).

Both rows count the global batch per step, so their samples/s compare directly::

    torchstrategies bench train --nproc 2 --strategy keras-one-process --strategy keras-mwms --no-in-process

Keras is imported only when a row is set up, in the workers (``KERAS_BACKEND=torch``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torchstrategies.bench.mlp import SIZES
from torchstrategies.bench.train import BenchContext, register_runner

__all__: list[str] = []


def _keras(ctx: BenchContext) -> Any:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras

    keras.utils.set_random_seed(ctx.seed)
    return keras


def _model(keras: Any) -> Any:
    layers = [keras.Input((SIZES[0],))]
    layers += [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
    layers.append(keras.layers.Dense(SIZES[-1]))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _global_batch(ctx: BenchContext) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(ctx.seed)
    n = ctx.batch * ctx.world_size
    return (rng.standard_normal((n, SIZES[0]), dtype=np.float32),
            rng.integers(0, SIZES[-1], size=(n,)).astype(np.int64))


def _keras_mwms(ctx: BenchContext) -> tuple[Callable[[], None], Callable[[], None]]:
    keras = _keras(ctx)
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(keras)
    x, y = _global_batch(ctx)

    def step() -> None:
        model.train_on_batch(x, y)

    return step, strategy.shutdown


def _keras_one_process(ctx: BenchContext) -> tuple[Callable[[], None], Callable[[], None]]:
    keras = _keras(ctx)
    model = _model(keras)
    x, y = _global_batch(ctx)

    def step() -> None:
        if ctx.rank == 0:
            model.train_on_batch(x, y)

    return step, lambda: None


register_runner("keras-mwms", _keras_mwms, default=False)
register_runner("keras-one-process", _keras_one_process, default=False)
