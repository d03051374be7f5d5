"""The cross-worker transport used by MultiWorkerMirroredStrategy's gradient synchronizer.

One small interface (``all_reduce_async`` in place, ``all_gather``, ``broadcast_``) with two backings:

* :class:`TorchDistTransport`: torch.distributed's own collectives on the default (or given) group: the
  ``GLOO`` / ``NCCL`` implementation.
* :class:`CollectivesTransport`: ``torchstrategies.collectives`` with the chosen
  ``CommunicationImplementation`` (SHM, RING, TREE, hierarchical, AUTO).

The synchronizer packs gradients into buckets itself, so every call here moves one flat tensor.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.collectives import CommunicationOptions

__all__ = ["Handle", "Transport", "TorchDistTransport", "make_transport", "resolve_options"]

log = logging.getLogger("torchstrategies.multi_worker")


class Handle:
    """An in-flight collective; ``wait()`` returns once the result is in the caller's tensor."""

    def __init__(self, work: Any = None, finish: Any = None):
        self._work = work
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True


class Transport:
    """What the gradient synchronizer needs from a collective implementation."""

    name = "base"

    def __init__(self, group: Any = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_async(self, tensor: torch.Tensor) -> Handle:  # SUM, in place
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def all_gather_async(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], Handle]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        return out, Handle(work)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        for t in tensors:
            dist.broadcast(t, src=src, group=self.group)

    def close(self) -> None:
        pass


class TorchDistTransport(Transport):
    """torch.distributed's native all-reduce (gloo on CPU, NCCL on CUDA)."""

    name = "native"

    def all_reduce_async(self, tensor: torch.Tensor) -> Handle:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Handle(work)


class CollectivesTransport(Transport):
    """``torchstrategies.collectives`` with one CommunicationImplementation.

    Bucket buffers come from ``collectives.buffer`` (they live in the shared-memory segment when the
    implementation is SHM/AUTO on one host, so the all-reduce needs no copy in). CPU buckets are reduced
    synchronously in the caller's thread (on a CPU host a background thread only competes with backward
    for the same cores); CUDA buckets use ``all_reduce_async``.
    """

    def __init__(self, group: Any, options: Any):
        super().__init__(group)
        from torchstrategies import collectives

        self._c = collectives
        # The synchronizer already packs into buckets: ask the layer for no further splitting.
        self._options = _replace_options(options, bytes_per_pack=0)
        self.name = _impl_name(options)

    def alloc_flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=device)
        return self._c.buffer(numel, dtype, group=self.group, options=self._options)

    def all_reduce_async(self, tensor: torch.Tensor) -> Handle:
        if tensor.device.type == "cpu":
            self._c.all_reduce_(tensor, "sum", group=self.group, options=self._options)
            return Handle()
        handle = self._c.all_reduce_async(tensor, "sum", group=self.group, options=self._options)
        return Handle(None, handle.wait)


# --- options ---------------------------------------------------------------------------------------------


def resolve_options(options: Any) -> CommunicationOptions:
    """None -> default options; validates the type."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(f"communication_options must be a ts.CommunicationOptions, got {options!r}")
    return options


def _impl_name(options: Any) -> str:
    impl = getattr(options, "implementation", "AUTO")
    return str(getattr(impl, "name", impl)).upper()


def _replace_options(options: CommunicationOptions, **changes: Any) -> CommunicationOptions:
    kw = {"bytes_per_pack": options.bytes_per_pack, "timeout_seconds": options.timeout_seconds,
          "implementation": options.implementation}
    kw.update(changes)
    return CommunicationOptions(**kw)


def timeout_of(options: Any) -> datetime.timedelta | None:
    t = getattr(options, "timeout_seconds", None)
    return None if t is None else datetime.timedelta(seconds=float(t))


def make_transport(options: Any, group: Any = None, device: torch.device | None = None) -> Transport:
    """The transport for ``options.implementation`` (a priority list, first match wins):

    1. GLOO / NCCL -> torch.distributed's own all-reduce;
    2. anything else (AUTO, SHM, RING, TREE, HIERARCHICAL) -> ``torchstrategies.collectives`` with that
       implementation. AUTO resolves there by its table: SHM on one host (bucket buffers live in the shared
       segment: the zero-copy path), HIERARCHICAL across hosts, NCCL for CUDA tensors.
    """
    if _impl_name(options) in ("GLOO", "NCCL"):
        return TorchDistTransport(group)
    return CollectivesTransport(group, options)
