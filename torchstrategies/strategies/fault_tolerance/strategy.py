"""``FaultTolerantMultiWorkerMirroredStrategy``: MultiWorkerMirrored training that loses no step when a
worker dies (docs/fault_tolerance.md, "Fault-tolerant MultiWorkerMirrored").

The strategy places what is made in its scope on the worker's device (``cuda:LOCAL_RANK`` or cpu), joins
the job's membership in the launcher's TCPStore, and hands out the :class:`TransactionalLoop` that runs
each step as a transaction over the live workers. ``num_replicas_in_sync`` is the current generation's
size. ``strategy.reduce`` in ``step_fn`` before ``loss.backward()`` is part of the step (a lost member discards
and redoes it), after it raises ``CollectiveAfterCommitError``; outside a step it reduces over the current
generation (``UnavailableError`` if a member is lost meanwhile: the next step forms a new generation).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, cast

import torch

from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.distribute.distribute_lib import Strategy, StrategyExtended
from torchstrategies.distribute.values import Destinations, DistributedValues, Reducible, local_results
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies.fault_tolerance.global_batches import GlobalBatches
from torchstrategies.strategies.fault_tolerance.loop import TransactionalLoop
from torchstrategies.strategies.fault_tolerance.membership import Membership
from torchstrategies.strategies.fault_tolerance.options import FaultTolerance

__all__ = ["FaultTolerantMultiWorkerMirroredStrategy", "FaultTolerantExtended"]

_IMPLEMENTATIONS = (CommunicationImplementation.GLOO, CommunicationImplementation.AUTO,
                    CommunicationImplementation.SHM, CommunicationImplementation.RING)


class FaultTolerantExtended(StrategyExtended):
    """The extended API of :class:`FaultTolerantMultiWorkerMirroredStrategy`."""

    def __init__(self, container: Strategy, fault_tolerance: FaultTolerance,
                 implementation: CommunicationImplementation) -> None:
        super().__init__(container)
        if not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(f"fault_tolerance must be a ts.FaultTolerance, got {fault_tolerance!r}")
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"the fault-tolerant mode runs on {[i.name for i in _IMPLEMENTATIONS]}, got "
                             f"{implementation.name}")
        self.fault_tolerance = fault_tolerance
        self.implementation = implementation
        if torch.cuda.is_available():
            self._device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self._device)
        else:
            self._device = torch.device("cpu")
        self._worker_devices = (self._device,)
        self.membership = Membership(fault_tolerance)
        self._loops: list[TransactionalLoop] = []
        self._closed = False

    @property  # type: ignore[override]
    def _num_replicas_in_sync(self) -> int:
        gen = self._loops[-1].generation if self._loops else None
        return gen.size if gen is not None else 1

    @_num_replicas_in_sync.setter
    def _num_replicas_in_sync(self, value: int) -> None:
        pass  # the base class sets 1; the size is the current generation's

    def _create_parameter(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
                          ) -> torch.nn.Parameter | None:
        if param.device == self._device:
            return None
        return torch.nn.Parameter(param.detach().to(self._device), requires_grad=param.requires_grad)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor | None:
        return None if buffer.device == self._device else buffer.to(self._device)

    def training_loop(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: GlobalBatches,
                      scheduler: Any = None) -> TransactionalLoop:
        if not isinstance(data, GlobalBatches):
            raise TypeError(f"data must be a GlobalBatches (strategy.global_batches(dataset, ...)), got {data!r}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("training_loop: the model has no trainable parameter")
        if self._loops:
            raise RuntimeError("this strategy already has a training loop (one per job)")
        loop = TransactionalLoop(self.membership, self.fault_tolerance.min_workers,
                                 self.fault_tolerance.timeout_seconds, self.implementation, self._device, model,
                                 optimizer, data, scheduler)
        self._loops.append(loop)
        return loop

    def _reduce_to(self, op: ReduceOp, value: Reducible, destinations: Destinations | None,
                   options: object) -> Any:
        comps = local_results(value) if isinstance(value, DistributedValues) else (value,)
        t = torch.as_tensor(comps[0]).detach().clone()
        loop = self._loops[-1] if self._loops else None
        if loop is not None:
            if op is ReduceOp.MEAN:
                t = t.to(torch.promote_types(t.dtype, torch.float32))
            (t,) = loop.all_reduce(ReduceOp.SUM if op is ReduceOp.MEAN else op, [t], "strategy.reduce")
            if op is ReduceOp.MEAN and loop.generation is not None:
                t = t / loop.generation.size
        return self._to_destinations(t, self._destination_devices(destinations))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for loop in self._loops:
            loop.close()
        self._loops.clear()
        self.membership.close()
        self._release_torch_patches()


class FaultTolerantMultiWorkerMirroredStrategy(Strategy):
    """MultiWorkerMirrored training whose steps are transactions over the live workers.

    A worker that dies or freezes costs no step: the survivors discard the step in flight, form a new
    generation and redo it with the same global batch split among themselves; a restarted worker copies
    the live state from a peer and joins at a step boundary. Launch it with a launcher that hosts the store
    and restarts each worker on its own (``python -m torchstrategies.strategies.fault_tolerance.launch``).

    Args:
        fault_tolerance: ``ts.FaultTolerance(min_workers=..., timeout_seconds=...)``.
        implementation: the collectives of each generation's group: ``"GLOO"`` (default) or our backend
            (``"AUTO"``, ``"SHM"``, ``"RING"``).

    Example:
        >>> import torch, torchstrategies as ts                                     # doctest: +SKIP
        >>> strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(ts.FaultTolerance(min_workers=2))  # doctest: +SKIP
        >>> with strategy.scope():                                                 # doctest: +SKIP
        ...     model = torch.nn.Linear(4, 1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> data = ts.GlobalBatches(dataset, global_batch_size=64, seed=0)         # doctest: +SKIP
        >>> loop = strategy.training_loop(model, opt, data)                        # doctest: +SKIP
        >>> def step_fn(batch):                                                    # doctest: +SKIP
        ...     x, y = batch
        ...     loss = ts.compute_average_loss((model(x) - y).pow(2).squeeze(1), global_batch_size=64)
        ...     loss.backward()          # the commit point: .grad is the global gradient after it
        ...     opt.step()
        ...     opt.zero_grad()
        ...     return loss.detach()
        >>> while loop.steps < 100:                                                # doctest: +SKIP
        ...     loop.step(step_fn)
    """

    def __init__(self, fault_tolerance: FaultTolerance | None = None,
                 implementation: CommunicationImplementation | str = CommunicationImplementation.GLOO) -> None:
        impl = implementation if isinstance(implementation, CommunicationImplementation) else \
            CommunicationImplementation[str(implementation).upper()]
        super().__init__(FaultTolerantExtended(self, fault_tolerance if fault_tolerance is not None
                                               else FaultTolerance(), impl))

    @property
    def extended(self) -> FaultTolerantExtended:
        return cast(FaultTolerantExtended, self._extended)

    def training_loop(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: GlobalBatches,
                      scheduler: Any = None) -> TransactionalLoop:
        """The job's :class:`TransactionalLoop` over ``model``, ``optimizer``, ``data`` and ``scheduler``."""
        return self.extended.training_loop(model, optimizer, data, scheduler)

    def shutdown(self) -> None:
        """Leaves the group, stops the heartbeat and releases the strategy's hooks."""
        with contextlib.suppress(Exception):
            self.extended.shutdown()

    def __enter__(self) -> FaultTolerantMultiWorkerMirroredStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
