"""A small parameter-server job, one task per process (RANK 0: chief, 1: ps, 2: worker; torchrun's
environment): the chief trains a counter model for a few steps, prints ``RESULT <weight>`` and returns
without calling ``shutdown()``, as user scripts do (the strategy shuts the cluster down at exit). Every
task is expected to exit 0."""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time

from _ps_bodies import counter_model

import torchstrategies as ts


def _threads_left() -> None:
    """Registered before the strategy: runs after its own exit handler, and names what still runs. The
    library joins its own threads in ``shutdown()``; gRPC's internal helper threads (a stream's request
    consumer, named ``Thread-N (_run)``) end on their own once their channel is closed, so every thread gets
    up to 5 s in all to end before it counts as left running."""
    deadline = time.monotonic() + 5.0
    for t in threading.enumerate():
        if t is not threading.main_thread():
            t.join(max(0.0, deadline - time.monotonic()))
    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    print("THREADS", json.dumps(left), flush=True)


def main() -> int:
    atexit.register(_threads_left)
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type != "chief":
        ts.distribute.Server(resolver, timeout=60, lease_timeout=60).join()
        return 0
    strategy = ts.ParameterServerStrategy(resolver, timeout=60)
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    model, _, step = counter_model(strategy)
    for _ in range(3):
        coordinator.schedule(step)
    coordinator.join()
    print("RESULT", float(model.weight.detach().reshape(())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
