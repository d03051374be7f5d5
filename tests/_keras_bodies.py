"""Keras 3 (torch backend) workloads for tests/test_keras.py: one process without a strategy is the
reference; the same function runs in each MultiWorkerMirrored rank (``tests.harness.run_ranks``)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "torch")

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS = 37, 5, 8, 3  # 37 rows: a final batch of 5 splits 3 + 2


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    return x, y


def build(kind: str) -> Any:
    """A small MLP (``mlp``) or one with BatchNormalization and Dropout (``bn``), with a layer that counts
    the rows each training forward pass sees (``model.rows_seen``)."""
    import keras

    import torchstrategies as ts

    class RowCounter(keras.layers.Layer):
        seen: dict[int, int] = {}  # replica of this process -> rows its training forward passes saw

        def call(self, x, training=False):
            if training:
                rc = ts.get_replica_context()
                replica = 0 if rc is None or ts.in_cross_replica_context() else rc.replica_id_in_sync_group
                RowCounter.seen[replica] = RowCounter.seen.get(replica, 0) + int(x.shape[0])
            return x

    keras.utils.set_random_seed(1)
    if kind == "subclassed":  # built at its first batch, in fit

        class MLP(keras.Model):
            def __init__(self):
                super().__init__()
                self.count, self.hidden, self.out = RowCounter(), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)

            def call(self, x, training=False):
                return self.out(self.hidden(self.count(x, training=training)))

        RowCounter.seen = {}
        model = MLP()
        model.row_counter = RowCounter
        return model
    layers = [keras.layers.Input((FEATURES,)), RowCounter(), keras.layers.Dense(8, activation="relu")]
    if kind == "bn":
        layers += [keras.layers.BatchNormalization(), keras.layers.Dropout(0.3)]
    layers += [keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    RowCounter.seen = {}
    model.row_counter = RowCounter
    return model


def fit_inputs(source: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``fit`` that give the same global batches from NumPy arrays, a torch DataLoader or
    a Python generator."""
    import torch

    x, y = data()
    if source == "arrays":
        return (x, y), {"batch_size": GLOBAL_BATCH, "shuffle": False}
    if source == "loader":
        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return (torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH),), {}

    def batches():
        while True:
            for i in range(0, ROWS, GLOBAL_BATCH):
                yield x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]

    return (batches(),), {"steps_per_epoch": -(-ROWS // GLOBAL_BATCH)}


def train(model: Any, jit_compile: bool = False, source: str = "arrays", shuffle_seed: int | None = None
          ) -> dict[str, Any]:
    """Compiles and fits ``model`` (made in or out of a scope) on the global batches; returns what the tests
    compare."""
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse", metrics=["mae"],
                  jit_compile=jit_compile)
    x, y = data()
    args, kwargs = fit_inputs(source)
    if shuffle_seed is not None:  # Keras' default shuffle=True: a torch RandomSampler seeded from torch's state
        import torch

        torch.manual_seed(shuffle_seed)
        kwargs["shuffle"] = True
    history = model.fit(*args, epochs=EPOCHS, verbose=0, **kwargs)
    rows = dict(model.row_counter.seen)
    evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    prediction = model.predict(x[:6], batch_size=4, verbose=0)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history,
            "evaluate": evaluation, "predict": prediction, "rows": rows}


def plain(kind: str) -> dict[str, Any]:
    return train(build(kind))


def in_process(strategy_name: str, kind: str) -> dict[str, Any]:
    import torchstrategies as ts

    strategy = (ts.MirroredStrategy(num_replicas=2) if strategy_name == "mirrored2"
                else ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"))
    with strategy.scope():
        model = build(kind)
    return train(model)


def mwms_rank(rank: int, world: int, kind: str, source: str = "arrays", shuffle: bool = False) -> dict[str, Any]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = build(kind)
        return train(model, source=source, shuffle_seed=100 + rank if shuffle else None)
    finally:
        strategy.shutdown()


def mwms_jit(rank: int, world: int) -> str:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = build("mlp")
        try:
            train(model, jit_compile=True)
        except NotImplementedError as e:
            return str(e)
        return "trained"
    finally:
        strategy.shutdown()


def mwms_checkpoint(rank: int, world: int, directory: str) -> list[str]:
    """Fits with a ModelCheckpoint to ``directory`` (the same on every worker); returns where it saved."""
    import keras

    import torchstrategies as ts

    saved: list[str] = []

    class Recording(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            super()._save_model(epoch, batch, logs)
            saved.append(str(self.filepath))

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = build("mlp")
        model.compile(optimizer="sgd", loss="mse")
        x, y = data()
        path = os.path.join(directory, "model.keras")
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[Recording(path)])
        assert os.path.exists(path) or rank != 0
        return saved
    finally:
        strategy.shutdown()


def train_on_batches(model: Any) -> list[np.ndarray]:
    """``train_on_batch`` on global batches of 8 rows, as numpy arrays (Keras hands its step numpy there)."""
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    x, y = data()
    for start in range(0, 32, 8):
        model.train_on_batch(x[start:start + 8], y[start:start + 8])
    return [np.asarray(w) for w in model.get_weights()]


def mwms_train_on_batch(rank: int, world: int) -> list[np.ndarray]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = build("mlp")
        return train_on_batches(model)
    finally:
        strategy.shutdown()
