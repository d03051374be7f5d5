"""Every cross-worker call of a MultiWorkerMirroredStrategy (``strategy.extended``'s ``broadcast_tensors``,
``all_reduce_tensors``, ``all_gather_parts``, ``barrier``, and the core's ``reduce_to`` / ``gather``): each
goes through the strategy's one process group (its ``CollectiveAllReduce``), and a failure is named by the
strategy's ``HealthMonitor`` (which peer, which operation). Gradients do not pass here: they go through
the gradient synchronizer's hook (``_grad_sync.py``) on the same group. A call made inside a function
``torch.compile`` traces (a compiled step function: the optimizer step's pre-hook, ``all_reduce`` in the
step) runs eagerly: dynamo breaks the graph there (the strategy wraps ``_guard`` in ``torch.compiler.disable``
when it is made, not at import: see ``MultiWorkerMirroredExtended.__init__``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from torchstrategies.collectives import CommunicationOptions
from torchstrategies.distribute.collective_all_reduce import CollectiveAllReduce, PendingAllReduce
from torchstrategies.distribute.distribute_lib import StrategyExtended
from torchstrategies.distribute.values import (
    Destinations,
    DistributedValues,
    Mirrored,
    Reducible,
    local_results,
)
from torchstrategies.errors import TorchStrategiesError
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies._health import HealthMonitor

__all__ = ["WorkerCollectives"]

T = TypeVar("T")


class WorkerCollectives(StrategyExtended):
    """The cross-worker calls of ``MultiWorkerMirroredExtended`` (its base): the subclass sets the group's
    ``CollectiveAllReduce`` and the ``HealthMonitor`` that names a failure."""

    _cross_device_ops: CollectiveAllReduce
    _health: HealthMonitor

    def _guard(self, fn: Callable[[], T], what: str, started: bool = True) -> T:
        self._health.seq += started   # (a wait for a collective started earlier is not a new one)
        try:
            return fn()
        except (RuntimeError, TimeoutError) as exc:
            if isinstance(exc, TorchStrategiesError):
                raise
            raise self._health.diagnose(exc, what) from exc

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrites ``tensors`` in place with rank ``src``'s values (packed per dtype). Every worker calls it."""
        self._guard(lambda: self._cross_device_ops.broadcast_(tensors, src), "broadcast")

    def all_reduce_tensors(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor],
                           options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """Each tensor reduced over every worker (new tensors), in any context. Every worker calls it."""
        rop = ReduceOp.from_any(op)
        return self._guard(lambda: self._cross_device_ops.all_reduce_tensors(rop, tensors, options),
                           f"{rop.name} all-reduce")

    def all_reduce_in_place(self, op: ReduceOp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (on the rank's device) reduced over every worker in place, at once, and returned: the
        lean path of the agreement check's few int64 numbers (no packing or copy). Every worker calls it."""
        self._guard(lambda: self._cross_device_ops.all_reduce_in_place(op, tensors), f"{op.name} all-reduce")
        return tensors

    def all_reduce_tensors_async(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor]) -> PendingAllReduce:
        """:meth:`all_reduce_tensors` started now; the handle's ``wait()`` returns the reduced tensors. Every
        worker starts it, and waits for it, in the same order."""
        rop = ReduceOp.from_any(op)
        what = f"{rop.name} all-reduce"
        pending = self._guard(lambda: self._cross_device_ops.all_reduce_tensors_async(rop, tensors), what)
        return PendingAllReduce(lambda: self._guard(pending.wait, what, started=False))

    def all_gather_parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``t`` (rank >= 1, its length along dim 0 may differ), in rank order, on every worker
        (the sizes, then the rows padded to the longest: two all-gathers). Every worker calls it."""
        return self._guard(lambda: self._cross_device_ops.gather_parts(t), "all-gather")

    def barrier(self) -> None:
        """Returns when every worker has called it; a dead or hung worker raises a named error."""
        self._guard(self._cross_device_ops.barrier, "barrier")

    def _reduce_to(self, op: ReduceOp, value: Reducible, destinations: Destinations | None,
                   options: CommunicationOptions | None) -> torch.Tensor | Mirrored[torch.Tensor]:
        return self._batch_reduce_to(op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, op: ReduceOp, pairs: Sequence[tuple[Reducible, Destinations | None]],
                         options: CommunicationOptions | None) -> list[torch.Tensor | Mirrored[torch.Tensor]]:
        tensors = []
        for v, _ in pairs:
            comps = local_results(v) if isinstance(v, DistributedValues) else (v,)
            if len(comps) != 1:
                raise ValueError(f"MultiWorkerMirroredStrategy has one replica per worker, got {len(comps)} "
                                 f"components in {v!r}")
            tensors.append(torch.as_tensor(comps[0]))
        reduced = self.all_reduce_tensors(op, tensors, options)
        return [self._to_destinations(r, self._destination_devices(d)) for r, (_, d) in zip(reduced, pairs)]

    def _gather_to(self, value: Reducible, destinations: Destinations | None, axis: int,
                   options: CommunicationOptions | None) -> torch.Tensor | Mirrored[torch.Tensor]:
        comps = local_results(value) if isinstance(value, DistributedValues) else (value,)
        t = torch.as_tensor(comps[0])
        if t.dim() == 0:
            raise ValueError(f"gather needs a tensor of rank >= 1 to concatenate along axis {axis}, got a scalar")
        out = self._guard(lambda: self._cross_device_ops.gather(t, axis, options), "all-gather")
        return self._to_destinations(out, self._destination_devices(destinations))
