"""Metric-driven schedulers (``ReduceLROnPlateau.step(metric)``) under the strategies: one step per training
step, on one value that every replica agrees on.

A replica's loss or metric is of its own rows; the scheduler needs the global one, and which reduction
gives it depends on how the value was made (``compute_average_loss`` divides by the global batch, so the
global loss is the replicas' SUM; a metric each replica averages over its own rows needs their MEAN). So the
strategy does not guess: the metric must already be global, the same on every replica, and the scheduler
steps once with it; replicas that pass different values get a ``ValueError`` that says how to reduce it.

* In-process (Mirrored, CentralStorage): ``step`` inside ``run`` is a merge_call (once per step, not once per
  replica) that compares the replicas' values.
* MultiWorkerMirrored: ``step`` of a scheduler over an optimizer of the strategy compares the ranks' values
  with one small all-reduce (MAX of ``[x, -x]``: equal iff the maximum is the minimum), inside or outside
  ``run``, so the ranks' learning rates cannot drift apart.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchstrategies.distribute.mirrored_run import current_replica, merge_call
from torchstrategies.distribute.values import local_results

__all__ = ["in_process_plateau_step", "multi_worker_plateau_step"]

_HOW = (
    "Pass the global metric, the same on every replica: inside strategy.run, "
    "ts.get_replica_context().all_reduce('sum', loss) for a loss made by ts.compute_average_loss (each replica "
    "holds its share of the global mean), or all_reduce('mean', metric) for a metric each replica averages "
    "over an equal share of rows; or step the scheduler after strategy.run with "
    "strategy.reduce('sum', per_replica_loss, axis=None)"
)


def _disagreement(values: Sequence[float], who: str) -> ValueError:
    shown = ", ".join(f"{who} {i}: {v!r}" for i, v in enumerate(values))
    return ValueError(
        f"ReduceLROnPlateau.step(metric) got different metrics ({shown}): each is of its own rows, and stepping "
        f"on any one of them (or once per {who}) would not follow the global metric as one device does. {_HOW}"
    )


def in_process_plateau_step(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``ReduceLROnPlateau.step`` for in-process replicas: inside ``run`` a merge_call that steps once, in
    cross-replica context, with the metric every replica passed (``ValueError`` if they differ)."""

    @functools.wraps(orig)
    def step(self: Any, metrics: Any, *args: Any, **kwargs: Any) -> Any:
        replica = current_replica()
        if replica is None:
            return orig(self, metrics, *args, **kwargs)

        def once(strategy: Any, metric: Any) -> Any:
            values = [float(v) for v in local_results(metric)]
            if any(v != values[0] for v in values[1:]):
                raise _disagreement(values, "replica")
            return orig(self, values[0], *args, **kwargs)

        once._torchstrategies_merge_key = (id(self), "ReduceLROnPlateau.step")  # type: ignore[attr-defined]
        return merge_call(replica, once, (metrics,), {})

    return step


def multi_worker_plateau_step(extended: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of ``ReduceLROnPlateau.step`` for a MultiWorkerMirrored strategy (``extended``, held
    weakly): the step of a scheduler over one of its optimizers first checks that every rank passed the same
    metric (one all-reduce; ``ValueError`` on every rank if not)."""
    ref = weakref.ref(extended)

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def step(self: Any, metrics: Any, *args: Any, **kwargs: Any) -> Any:
            ext = ref()
            if ext is not None and ext.owns_optimizer(self.optimizer):
                x = torch.tensor(float(metrics), dtype=torch.float64)
                (most,) = ext.all_reduce_tensors("max", [torch.stack([x, -x])])
                high, low = float(most[0]), -float(most[1])
                if high != low:
                    raise ValueError(
                        f"ReduceLROnPlateau.step(metric) got different metrics on the ranks (rank {ext.rank}: "
                        f"{float(x)!r}; they range from {low!r} to {high!r}): each is of its own rows, and the ranks' "
                        f"learning rates would drift apart. {_HOW}")
            return orig(self, metrics, *args, **kwargs)

        return step

    return wrap
