"""Keras 3 (torch backend) workloads for tests/test_keras.py: one process without a strategy is the
reference; the same function runs in each MultiWorkerMirrored rank (``tests.harness.run_ranks``)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "torch")

ROWS, FEATURES, GLOBAL_BATCH, EPOCHS = 37, 5, 8, 3  # 37 rows: a final batch of 5 splits 3 + 2


def data(rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
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
    if kind in ("custom_step", "custom_loss_fn"):  # a train_step of its own, as in Keras' torch guide
        return _custom_step_model(kind, RowCounter)
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


def _custom_step_model(kind: str, row_counter: Any) -> Any:
    """A model with the ``train_step`` of Keras' guide "Customizing what happens in fit() with PyTorch":
    ``compute_loss``, ``loss.backward()``, ``optimizer.apply``, the metrics updated by hand
    (``custom_loss_fn``: the loss from a Keras loss object instead of ``compute_loss``)."""
    import keras
    import torch

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            if kind == "custom_step":
                loss = self.compute_loss(y=y, y_pred=y_pred)
            else:
                loss = keras.losses.MeanSquaredError()(y, y_pred)
            loss.backward()
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.layers.Input((FEATURES,), dtype="float64")
    hidden = keras.layers.Dense(8, activation="relu", dtype="float64")(row_counter(dtype="float64")(inputs))
    model = CustomModel(inputs, keras.layers.Dense(1, dtype="float64")(hidden))
    row_counter.seen = {}
    model.row_counter = row_counter
    return model


def fit_inputs(source: str, rows: int = ROWS) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``fit`` that give the same global batches from NumPy arrays, a torch DataLoader or
    a Python generator."""
    import torch

    x, y = data(rows)
    if source == "arrays":
        return (x, y), {"batch_size": GLOBAL_BATCH, "shuffle": False}
    if source == "loader":
        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return (torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH),), {}

    def batches():
        while True:
            for i in range(0, rows, GLOBAL_BATCH):
                yield x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]

    return (batches(),), {"steps_per_epoch": -(-rows // GLOBAL_BATCH)}


def train(model: Any, jit_compile: bool = False, source: str = "arrays", shuffle_seed: int | None = None,
          rows: int = ROWS) -> dict[str, Any]:
    """Compiles and fits ``model`` (made in or out of a scope) on the global batches; returns what the tests
    compare."""
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse", metrics=["mae"],
                  jit_compile=jit_compile)
    x, y = data(rows)
    args, kwargs = fit_inputs(source, rows)
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


def plain(kind: str, rows: int = ROWS) -> dict[str, Any]:
    return train(build(kind), rows=rows)


def in_process(strategy_name: str, kind: str, rows: int = ROWS) -> dict[str, Any]:
    strategy = _strategy(strategy_name)
    with strategy.scope():
        model = build(kind)
    return train(model, rows=rows)


def mwms_rank(rank: int, world: int, kind: str, source: str = "arrays", shuffle: bool = False, rows: int = ROWS
              ) -> dict[str, Any]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = build(kind)
        return train(model, source=source, shuffle_seed=100 + rank if shuffle else None, rows=rows)
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


def _strategy(name: str) -> Any:
    import torchstrategies as ts

    return {"mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
            "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
            "central_storage2": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
            "central_storage3": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], parameter_device="cpu"),
            "mwms": ts.MultiWorkerMirroredStrategy}[name]()


def custom_step(strategy_name: str | None, kind: str = "custom_step", rows: int = ROWS) -> Any:
    """Fits the float64 model with its own train_step (``_custom_step_model``) on the global batches, without
    a strategy (None) or under one; returns its weights, or the error's type and text."""
    import keras

    strategy = None if strategy_name is None else _strategy(strategy_name)
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")  # the loss too (Keras computes it in floatx)
    try:
        if strategy is None:
            model = build(kind)
        else:
            with strategy.scope():
                model = build(kind)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse", metrics=["mae"])
        x, y = data(rows)
        try:
            model.fit(x.astype("float64"), y.astype("float64"), batch_size=GLOBAL_BATCH, epochs=EPOCHS,
                      shuffle=False, verbose=0)
        except RuntimeError as e:
            return ("error", str(e))
        return [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.config.set_floatx(floatx)
        if strategy_name == "mwms":
            strategy.shutdown()


def mwms_custom_step(rank: int, world: int, kind: str) -> Any:
    return custom_step("mwms", kind)


def mwms_replica_ids(rank: int, world: int) -> dict[str, Any]:
    """What code in a Keras model sees of its replica under MWMS: inside ``fit`` (called outside and inside
    the scope) and ``evaluate``, and in ``strategy.run`` on the same worker."""
    import keras

    import torchstrategies as ts

    seen: list[tuple[str, Any]] = []

    class Probe(keras.layers.Layer):
        def call(self, x, training=False):
            rc = ts.get_replica_context()
            if x.device.type != "meta":  # (not Keras' shape inference: no data, no replica, as in TF)
                seen.append(("train" if training else "test", None if rc is None else rc.replica_id_in_sync_group))
            return x

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = keras.Sequential([keras.layers.Input((FEATURES,)), Probe(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x, y = data()
        model.fit(x[:16], y[:16], batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        with strategy.scope():
            model.fit(x[:16], y[:16], batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
        model.evaluate(x[:16], y[:16], batch_size=GLOBAL_BATCH, verbose=0)
        in_run = strategy.run(lambda: ts.get_replica_context().replica_id_in_sync_group)
        return {"fit": sorted({r for _, r in seen}, key=str), "run": in_run}
    finally:
        strategy.shutdown()


def accumulated(strategy_name: str | None) -> list[np.ndarray]:
    """Fits the float64 MLP with ``SGD(gradient_accumulation_steps=2)`` (Keras' ``optimizer.iterations`` is then a
    tensor, not a variable) on the global batches, without a strategy (None) or under one; its weights."""
    import keras

    strategy = None if strategy_name is None else _strategy(strategy_name)
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    try:
        keras.utils.set_random_seed(0)
        if strategy is None:
            model = build("mlp")
        else:
            with strategy.scope():
                model = build("mlp")
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5, gradient_accumulation_steps=2), loss="mse")
        x, y = data()
        model.fit(x.astype("float64"), y.astype("float64"), batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0)
        return [np.asarray(w) for w in model.get_weights()]
    finally:
        keras.config.set_floatx(floatx)
