"""``CollectiveAllReduce``: MultiWorkerMirroredStrategy's one seam to the other workers, a torch ProcessGroup.

TF's ``tf.distribute.CrossDeviceOps`` of that name. Every cross-worker operation of the strategy goes through
the process group it holds, with public ``torch.distributed`` calls only (``all_reduce``, ``broadcast``,
``all_gather_single``, ``barrier``): ``strategy.reduce`` / ``gather``, ``extended.reduce_to`` /
``batch_reduce_to``, ``ReplicaContext.all_reduce`` (hence SyncBatchNorm and metrics), the broadcast of the
initial parameters, checkpoint agreement, barriers and input-pipeline agreement. Gradients travel through
the same group, from the gradient synchronizer's communication hook (``strategies/_grad_sync.py``).

Which group: :func:`_make_group` makes it from ``CommunicationOptions`` (``implementation`` picks the
backend, ``timeout_seconds`` its timeout); it is the ONE place that decides how workers talk. A call whose
own options ask for another implementation or timeout gets a group of its own, made once by the same
function. ``bytes_per_pack`` is applied here: tensors are packed per dtype into buffers of about that size.

Example (under torchrun):
    >>> import torch, torchstrategies as ts                                      # doctest: +SKIP
    >>> from torchstrategies.distribute.collective_all_reduce import CollectiveAllReduce
    >>> cao = CollectiveAllReduce(ts.CommunicationOptions(implementation="GLOO"))  # doctest: +SKIP
    >>> cao.all_reduce_tensors("sum", [torch.ones(3)])                           # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies import collectives
from torchstrategies.collectives import CommunicationImplementation, CommunicationOptions
from torchstrategies.collectives.packing import make_packs
from torchstrategies.distribute.cross_device_ops import CrossDeviceOps, _place
from torchstrategies.distribute.values import DistributedValues, local_results
from torchstrategies.reduce_op import ReduceOp

__all__ = ["CollectiveAllReduce", "PendingAllReduce"]

_DIST_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MEAN: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX}
# all_reduce_in_place's options per op, made once (every call the same: not rebuilt on the step's path).
_IN_PLACE_OPTIONS: dict[ReduceOp, dist.AllreduceOptions] = {}


def _make_group(options: CommunicationOptions) -> dist.ProcessGroup:
    """THE one function that makes the process group a MultiWorkerMirroredStrategy talks through.

    A collective call (every rank of the default group calls it, in the same order):
    ``collectives.new_group`` maps AUTO/SHM/RING/HIERARCHICAL to a group on the ``"torchstrategies"`` backend
    (AUTO on a CUDA machine: ``"cpu:torchstrategies,cuda:nccl"``), GLOO to gloo and NCCL to nccl;
    ``timeout_seconds`` (None: the default group's) bounds every collective of the group.
    """
    return collectives.new_group(options)


class PendingAllReduce:
    """An all-reduce in flight (``all_reduce_tensors_async``): ``wait()`` finishes it and returns the reduced
    tensors (the same ones on later calls; a failed wait raises again)."""

    def __init__(self, finish: Callable[[], list[torch.Tensor]]) -> None:
        self._finish: Callable[[], list[torch.Tensor]] | None = finish
        self._result: list[torch.Tensor] = []

    def wait(self) -> list[torch.Tensor]:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        return self._result


class CollectiveAllReduce(CrossDeviceOps):
    """Cross-worker reductions over one torch ProcessGroup (TF's ``CollectiveAllReduce``).

    Args:
        options: the default ``CommunicationOptions`` (a call's own options override its set fields).
        group: a process group to adopt (the user's); None makes one from ``options`` (a collective call).

    Raises:
        ValueError: both a ``group`` and an explicit ``options.implementation`` (the group decides).
    """

    def __init__(self, options: CommunicationOptions | None = None, group: dist.ProcessGroup | None = None) -> None:
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"communication_options must be a ts.CommunicationOptions, got {options!r}")
        self.options = options if options is not None else CommunicationOptions()
        self._groups: dict[tuple[CommunicationImplementation, float | None], dist.ProcessGroup] = {}
        self.owned_groups: list[dist.ProcessGroup] = []  # the groups made here (the strategy destroys them)
        if group is not None:
            if self.options.implementation is not CommunicationImplementation.AUTO:
                raise ValueError(
                    f"pass either a process_group or communication_options.implementation "
                    f"({self.options.implementation.name}), not both: the group decides how workers talk")
            self._groups[self._key(self.options)] = group
        self.group = self._group(self.options)
        self.world_size = self.group.size()
        self.rank = self.group.rank()

    @property
    def implementation_name(self) -> str:
        return self.options.implementation.name

    def _merged(self, options: object) -> CommunicationOptions:
        if options is None or not isinstance(options, CommunicationOptions):
            return self.options
        return self.options.merge(options)

    @staticmethod
    def _key(options: CommunicationOptions) -> tuple[CommunicationImplementation, float | None]:
        return options.implementation, options.timeout_seconds

    def _group(self, options: CommunicationOptions) -> dist.ProcessGroup:
        """The group for ``options`` (made on first use: every rank makes the same call at the same time)."""
        key = self._key(options)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _make_group(options)
            self.owned_groups.append(g)
        return g

    # --- tensors ------------------------------------------------------------------------------------------
    def all_reduce_tensors(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor],
                           options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """Returns each tensor reduced over every worker (new tensors; MEAN divides by the world size)."""
        return self._all_reduce(op, tensors, options, async_op=False).wait()

    def all_reduce_in_place(self, op: ReduceOp, tensors: Sequence[torch.Tensor]) -> None:
        """Reduces each tensor over every worker in place, at once, one collective each on the strategy's group:
        the lean path for a few numbers (the agreement check's payload), with no packing and no copy. SUM, MIN
        or MAX (MEAN of integers has no in-place result)."""
        opts = _IN_PLACE_OPTIONS.get(op)
        if opts is None:
            if op is ReduceOp.MEAN:
                raise ValueError("all_reduce_in_place reduces with SUM, MIN or MAX, got MEAN (use all_reduce_tensors)")
            opts = _IN_PLACE_OPTIONS[op] = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp(_DIST_OP[op])
            opts.asyncOp = False   # waited for at once: our backend then runs it on the caller's thread
        for t in tensors:
            self.group.allreduce([t], opts).wait()

    def all_reduce_tensors_async(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor],
                                 options: CommunicationOptions | None = None) -> PendingAllReduce:
        """:meth:`all_reduce_tensors` started now (the inputs are copied: they may change at once); the handle's
        ``wait()`` returns the reduced tensors. Every worker starts it, and waits for it, in the same order."""
        return self._all_reduce(op, tensors, options, async_op=True)

    def _all_reduce(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor], options: CommunicationOptions | None,
                    async_op: bool) -> PendingAllReduce:
        rop = ReduceOp.from_any(op)
        items = [t.detach() for t in tensors]
        if rop is ReduceOp.MEAN:
            for t in items:
                if not (t.is_floating_point() or t.is_complex()):
                    raise ValueError(f"cannot MEAN-reduce an integer tensor of dtype {t.dtype} across workers")
        opts = self._merged(options)
        group = self._group(opts)
        out: list[torch.Tensor] = list(items)
        works: list[Any] = []
        flats: list[tuple[torch.Tensor, Any]] = []
        for pack in make_packs(items, opts.bytes_per_pack):
            if pack.numel == 0:  # only empty tensors: nothing to send
                for i in pack.indices:
                    out[i] = items[i].clone()
                continue
            flat = pack.fill(items, None)  # a copy: the inputs stay untouched
            works.append(dist.all_reduce(flat, op=_DIST_OP[rop], group=group, async_op=async_op))
            flats.append((flat, pack))

        def finish() -> list[torch.Tensor]:
            for work in works:
                if work is not None:
                    work.wait()
            for flat, pack in flats:
                if rop is ReduceOp.MEAN:
                    flat.div_(self.world_size)
                for i, v in pack.views(items):
                    out[i] = v
            return out

        return PendingAllReduce(finish)

    def gather(self, t: torch.Tensor, axis: int = 0, options: CommunicationOptions | None = None) -> torch.Tensor:
        """Concatenates every worker's ``t`` along ``axis``; the sizes along ``axis`` may differ."""
        if t.dim() == 0:
            raise ValueError(f"gather needs a tensor of rank >= 1 to concatenate along axis {axis}, got a scalar")
        axis = axis % t.dim()
        parts = self.gather_parts(t.detach().movedim(axis, 0), options)
        return torch.cat(parts, dim=0).movedim(0, axis)

    def gather_parts(self, t: torch.Tensor, options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """Every worker's ``t`` (rank >= 1; the sizes along dim 0 may differ), in rank order: two all-gathers,
        the sizes first, then each worker's rows zero-padded to the longest."""
        x = t.detach().contiguous()
        group = self._group(self._merged(options))
        n = self.world_size
        sizes = torch.empty(n, dtype=torch.int64, device=x.device)
        dist.all_gather_single(sizes, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), group=group)
        counts = sizes.tolist()
        if max(counts) == 0:  # nothing to send
            return [x[:0].clone() for _ in counts]
        pad = torch.zeros((max(counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        pad[: x.shape[0]] = x
        parts = torch.empty((n * pad.shape[0],) + tuple(pad.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(parts, pad, group=group)  # the workers' pads, concatenated along dim 0
        parts = parts.view((n,) + tuple(pad.shape))
        return [parts[i, :k] for i, k in enumerate(counts)]

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0,
                   options: CommunicationOptions | None = None) -> None:
        """Overwrites ``tensors`` in place with group rank ``src``'s values (packed per dtype/device)."""
        items = [t.detach() for t in tensors]
        group = self._group(self._merged(options))
        for pack in make_packs(items, 0):
            if pack.numel == 0:
                continue
            flat = pack.fill(items, None)
            dist.broadcast(flat, group=group, group_src=src)
            with torch.no_grad():
                pack.copy_back(items)

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Returns when every worker has called it (within the group's timeout)."""
        dist.barrier(group=self._group(self._merged(options)))

    # --- CrossDeviceOps -----------------------------------------------------------------------------------
    def batch_reduce_implementation(self, op: ReduceOp, pairs: list[tuple[DistributedValues, tuple[torch.device,
                                    ...]]], options: CommunicationOptions | None) -> list[Any]:
        tensors = []
        for v, _ in pairs:
            comps = local_results(v)
            if len(comps) != 1:
                raise ValueError(f"CollectiveAllReduce reduces one replica per worker, got {len(comps)} "
                                 f"components in {v!r}")
            tensors.append(torch.as_tensor(comps[0]))
        reduced = self.all_reduce_tensors(op, tensors, options)
        return [_place(r, devices) for r, (_, devices) in zip(reduced, pairs, strict=True)]

    def __repr__(self) -> str:
        return f"CollectiveAllReduce({self.options!r}, backend={dist.get_backend(self.group)!r})"
