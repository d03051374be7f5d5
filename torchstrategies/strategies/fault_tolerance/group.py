"""The collectives of a fault-tolerant step: each generation's group, the step's flat buffers, and the
all-reduces and broadcasts over the group, waited for at once (our backend runs them on the caller's thread),
whose failure is one named exception (``CollectiveFailed``).

A member leaves a group with :meth:`Group.close`; ``abort=True`` (it discards the step in flight) tears the
group down for every member, so that a peer waiting in, or entering, a collective of it fails at once
instead of after the timeout: our backend marks its shared-memory segment aborted and closes its ring
sockets (``Backend::abort``); gloo has no abort (``ProcessGroupGloo.abort`` does nothing), but its
connections close when the group is destroyed, and the peers' pending operations on them fail at once
("Connection closed by peer"). So the ``Group`` is the only holder of the backend: nothing else (a frame
of a traceback, a Work) keeps it alive past :meth:`close`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.collectives import CommunicationImplementation
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies.fault_tolerance.membership import Generation

__all__ = ["Group", "Flat", "CollectiveFailed"]

_C10D_OPS: dict[ReduceOp, Any] = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
                                   ReduceOp.MIN: dist.ReduceOp.MIN}


class CollectiveFailed(Exception):
    """A collective over the generation's group failed (a member was lost or left)."""


class Group:
    """Generation ``gen``'s process group over its own key prefix of ``store`` (made by every member
    together: a collective).

    Args:
        store: the job's store.
        gen: the generation (this worker's index is its rank).
        timeout: seconds every collective may take.
        implementation: GLOO, or one of our backend's (AUTO, SHM, RING).

    Raises:
        CollectiveFailed: the group could not be made (a member was lost meanwhile).
    """

    def __init__(self, store: dist.Store, gen: Generation, timeout: float,
                 implementation: CommunicationImplementation) -> None:
        prefixed = dist.PrefixStore(f"g{gen.number}/pg/", store)
        pg: Any
        try:
            if implementation is CommunicationImplementation.GLOO:
                pg = dist.ProcessGroupGloo(prefixed, gen.index, gen.size, datetime.timedelta(seconds=timeout))
            else:
                from torchstrategies.collectives import backend

                impl = backend._implementation(implementation.name)
                pg = backend.make(prefixed, gen.index, gen.size, timeout, list(range(gen.size)),
                                  f"fault-tolerant generation {gen.number}", impl)
        except RuntimeError as exc:  # our backend's UnavailableError / DeadlineExceededError, gloo's errors
            raise CollectiveFailed(f"the group of generation {gen.number} could not be made: {exc}") from None
        self._pg = pg
        self.number = gen.number

    def rank(self) -> int:
        return int(self._backend().rank())

    def _backend(self) -> Any:
        if self._pg is None:
            raise CollectiveFailed(f"the group of generation {self.number} was closed")
        return self._pg

    def all_reduce(self, op: ReduceOp, tensors: list[torch.Tensor]) -> None:
        """``tensors`` reduced over the group in place, now.

        Raises:
            CollectiveFailed: it failed (a member was lost or left).
        """
        opts = dist.AllreduceOptions()
        opts.reduceOp = _C10D_OPS[op]
        opts.asyncOp = False  # waited for at once: our backend runs it on the caller's thread (no hand-off)
        try:
            self._backend().allreduce(tensors, opts).wait()
        except RuntimeError as exc:
            raise CollectiveFailed(f"all-reduce failed: {exc}") from None

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Member ``src``'s ``tensor`` into every member's, now.

        Raises:
            CollectiveFailed: it failed (a member was lost or left).
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.asyncOp = False
        try:
            self._backend().broadcast([tensor], opts).wait()
        except RuntimeError as exc:
            raise CollectiveFailed(f"broadcast failed: {exc}") from None

    def close(self, abort: bool) -> None:
        """This member leaves the group; ``abort``: it leaves in the middle of a step (or of a heal), and the
        peers' collectives over the group fail at once (see the module docstring)."""
        pg, self._pg = self._pg, None
        if pg is not None and abort:
            pg.abort()
        del pg  # the last reference: gloo's connections close here


class Flat:
    """One dtype's part of the step's all-reduce: the gradients (the parameters' ``.grad`` are views into
    it during backward), then the float MEAN buffers of that dtype, then (in the first) ``extra``: the
    per-parameter "had a gradient" flags and the joiners this member saw."""

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
