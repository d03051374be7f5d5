"""The collectives of a fault-tolerant step: each generation's group, the step's flat buffers, and an
all-reduce over the group, waited for at once (our backend runs it on the caller's thread), whose failure is
one named exception (``CollectiveFailed``)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies.fault_tolerance.membership import Generation

__all__ = ["Group", "Flat", "CollectiveFailed", "make_group", "all_reduce"]

Group = Any  # a c10d ProcessGroupGloo or our backend: both have allreduce / broadcast returning a Work

_C10D_OPS: dict[ReduceOp, Any] = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
                                   ReduceOp.MIN: dist.ReduceOp.MIN}


def make_group(store: dist.Store, gen: Generation, timeout: float, implementation: CommunicationImplementation
               ) -> Group:
    """The generation's group, over its own key prefix (a collective of the generation's members)."""
    prefixed = dist.PrefixStore(f"g{gen.number}/pg/", store)
    if implementation is CommunicationImplementation.GLOO:
        return dist.ProcessGroupGloo(prefixed, gen.index, gen.size, datetime.timedelta(seconds=timeout))
    from torchstrategies.collectives import backend

    impl = backend._implementation(implementation.name)
    return backend.make(prefixed, gen.index, gen.size, timeout, list(range(gen.size)),
                        f"fault-tolerant generation {gen.number}", impl)


class Flat:
    """One dtype's part of the step's all-reduce: the gradients (the parameters' ``.grad`` are views into
    it during backward), then the float MEAN buffers of that dtype, then (in the first) the flags."""

    def __init__(self, params: list[torch.nn.Parameter], buffers: list[torch.Tensor], extra: int) -> None:
        p0 = (params or buffers)[0]
        self.params, self.buffers = params, buffers
        sizes = [t.numel() for t in params] + [b.numel() for b in buffers]
        self.flat = torch.zeros(sum(sizes) + extra, dtype=p0.dtype, device=p0.device)
        self.views, off = [], 0
        for t, n in zip(list(params) + list(buffers), sizes):
            self.views.append(self.flat[off:off + n].view_as(t))
            off += n
        self.extra = self.flat[off:]


class CollectiveFailed(Exception):
    """A collective over the generation's group failed (a member was lost)."""


def all_reduce(group: Group, op: ReduceOp, tensors: list[torch.Tensor]) -> None:
    """``tensors`` reduced over ``group`` in place, now.

    Raises:
        CollectiveFailed: it failed (a member was lost).
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = _C10D_OPS[op]
    opts.asyncOp = False  # waited for at once: our backend runs it on the caller's thread (no hand-off)
    try:
        group.allreduce(tensors, opts).wait()
    except RuntimeError as exc:
        raise CollectiveFailed(f"all-reduce failed: {exc}") from exc
