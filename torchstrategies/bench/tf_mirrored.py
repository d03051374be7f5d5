"""TensorFlow baseline of ``torchstrategies bench train --tf-python PATH``: TF's own MirroredStrategy.

Run by a Python that has TensorFlow (not this project's): it imports only tensorflow, numpy and the standard
library, never torchstrategies, so ``PATH script.py`` works from any venv. It builds the MLP the compile
rows of ``train_inproc.py`` train (784-1024-1024-10 by default, ReLU, softmax cross-entropy, plain SGD)
under ``tf.distribute.MirroredStrategy`` over N logical CPU devices and under
``tf.distribute.OneDeviceStrategy``, each stepped by one ``tf.function``: ``strategy.run`` of a replica
function (forward, ``compute_average_loss``, gradient, replica-context ``all_reduce`` SUM of the gradients,
a ``merge_call`` that updates every variable copy, as TF's optimizers do) and ``strategy.reduce`` of the
loss.

Protocol (one JSON object per line):

* stdout, once set up and traced: ``{"ready": true, "tf": VERSION, "rows": [...], "devices": [...],
  "intra_op": N, "inter_op": N}``.
* stdin, one request per line: ``{"row": "mirrored" | "one_device", "steps": S, "warmup": W}``; stdout
  answers ``{"row": ..., "seconds_per_step": T, "loss": L}`` (W untimed steps, then S timed ones). The
  caller interleaves these requests with its own rounds. End of stdin ends the process.
* A bad request answers ``{"error": "..."}`` and the process goes on.

Example:
    python tf_mirrored.py --replicas 2 --threads 1 --sizes 784,1024,1024,10 --batch 64 --lr 0.01
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import ModuleType
from typing import Any

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="logical CPU devices of the MirroredStrategy")
    p.add_argument("--threads", type=int, default=1, help="TF intra-op threads (and inter-op unless given)")
    p.add_argument("--inter-op", type=int, default=None, help="TF inter-op threads (default: --threads)")
    p.add_argument("--sizes", default="784,1024,1024,10", help="MLP layer widths, comma separated")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",")]
    if a.replicas < 1 or a.threads < 1 or a.batch < a.replicas or len(a.sizes) < 2:
        p.error(f"need replicas >= 1, threads >= 1, batch >= replicas and 2+ sizes; got {vars(a)}")
    return a


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _build(tf: ModuleType, np: ModuleType, a: argparse.Namespace, strategy: Any) -> Any:
    """The variables, per-replica data and traced step of ``strategy``; returns the step function."""
    rng = np.random.default_rng(a.seed)
    with strategy.scope():
        params = []
        for fan_in, fan_out in zip(a.sizes[:-1], a.sizes[1:]):
            bound = 1.0 / np.sqrt(fan_in)  # torch.nn.Linear's default init range
            params.append(tf.Variable(rng.uniform(-bound, bound, (fan_in, fan_out)).astype("float32")))
            params.append(tf.Variable(rng.uniform(-bound, bound, (fan_out,)).astype("float32")))
    x = rng.standard_normal((a.batch, a.sizes[0])).astype("float32")
    y = rng.integers(0, a.sizes[-1], (a.batch,)).astype("int32")
    n = strategy.num_replicas_in_sync
    xs, ys = np.array_split(x, n), np.array_split(y, n)

    def value(parts: list[Any]) -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.identity(parts[ctx.replica_id_in_sync_group])
        )

    dx, dy = value(xs), value(ys)
    lr = a.lr
    batch = a.batch

    def apply(strat: Any, grads_and_vars: list[tuple[Any, Any]]) -> None:
        for g, v in grads_and_vars:
            strat.extended.update(v, lambda var, grad: var.assign_sub(lr * grad), args=(g,), group=False)

    def replica_fn(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            h = xb
            for i in range(0, len(params), 2):
                h = tf.matmul(h, params[i]) + params[i + 1]
                if i + 2 < len(params):
                    h = tf.nn.relu(h)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=h)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, params)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
        ctx.merge_call(apply, args=(list(zip(grads, params)),))
        return loss

    @tf.function
    def step() -> Any:
        per_replica = strategy.run(replica_fn, args=(dx, dy))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    step()  # trace once, before "ready"
    return step


def main(argv: list[str] | None = None) -> int:
    """Sets TF up, announces ``ready`` and answers timing requests until stdin ends."""
    a = _parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.inter_op or a.threads)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.replicas)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategies = {
        "mirrored": tf.distribute.MirroredStrategy(devices[: a.replicas]),
        "one_device": tf.distribute.OneDeviceStrategy(devices[0]),
    }
    steps = {name: _build(tf, np, a, s) for name, s in strategies.items()}
    _emit({"ready": True, "tf": tf.__version__, "rows": list(steps), "devices": devices[: a.replicas],
           "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
           "inter_op": tf.config.threading.get_inter_op_parallelism_threads()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            fn = steps[req["row"]]
            n, warmup = int(req["steps"]), int(req.get("warmup", 0))
            if n < 1 or warmup < 0:
                raise ValueError(f"steps must be >= 1 and warmup >= 0, got {n}, {warmup}")
        except (ValueError, KeyError, TypeError) as e:
            _emit({"error": f"bad request {line.strip()[:200]!r}: {e!r}"})
            continue
        for _ in range(warmup):
            fn()
        loss = fn()  # a step outside the clock, to read the loss without a host sync inside it
        float(loss)
        t0 = time.perf_counter()
        for _ in range(n):
            loss = fn()
        loss_value = float(loss)  # waits for the last step
        _emit({"row": req["row"], "seconds_per_step": (time.perf_counter() - t0) / n, "loss": loss_value})
    return 0


if __name__ == "__main__":
    sys.exit(main())
