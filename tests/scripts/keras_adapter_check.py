"""Runs torchstrategies' Keras adapter against the Keras first on sys.path (tests/test_keras_adapter.py runs
it with the current Keras and with the previous minor release): every member the adapter names exists on
real Keras objects, and a small ``fit`` under MirroredStrategy(2) equals one process on the same global
batches. Prints one JSON line: the Keras version, what the checks found, the largest difference."""

from __future__ import annotations

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import keras
    import numpy as np

    from tests import _keras_bodies as K
    from torchstrategies.strategies import _keras_api as api

    model = K.build("bn")  # Dense, BatchNormalization, Dropout
    checked = ["model" if api.as_model(model) is not None else "no model"]
    for layer in api.layers(model):
        if api.batch_norm(layer) is not None:
            checked.append("batch_norm")
        random = api.random_layer(layer)
        if random is not None:
            api.check(random.seed_generator.state, api.KerasVariable, "seed state")
            checked.append("random_layer")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    compiled = api.compiled(model)
    assert compiled.optimizer is not None
    for v in [*compiled.metrics_variables, *compiled.non_trainable_variables, *compiled.trainable_variables,
              compiled.optimizer.iterations]:
        api.check(v, api.KerasVariable, f"variable {getattr(v, 'path', v)!r}")
    checked.append("variables")
    if api.model_checkpoint(keras.callbacks.ModelCheckpoint("/nonexistent/model.keras")) is not None:
        checked.append("model_checkpoint")

    want, got = K.plain("bn"), K.in_process("mirrored2", "bn")
    diffs = [float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) for g, w in zip(got["weights"], want["weights"])]
    diffs += [float(np.max(np.abs(np.asarray(got["history"][k]) - np.asarray(want["history"][k]))))
              for k in want["history"]]
    print(json.dumps({"keras": keras.__version__, "keras_file": keras.__file__, "checked": checked,
                      "weights": len(got["weights"]), "max_diff": max(diffs), "rows": got["rows"]}))


if __name__ == "__main__":
    main()
