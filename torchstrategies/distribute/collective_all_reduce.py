"""``CollectiveAllReduce``: the one seam between MultiWorkerMirroredStrategy and the other workers.

TF's ``tf.distribute.CrossDeviceOps`` of that name, built on ``torchstrategies.collectives``. Every
cross-worker reduction of the strategy goes through it: gradients (through a DDP-style communication hook),
``strategy.reduce`` / ``gather``, ``extended.reduce_to`` / ``batch_reduce_to``, the initial broadcast of
parameters, and metrics (which reduce through the strategy). Each call honours the strategy's
``CommunicationOptions`` merged with the call's own (``implementation``, ``timeout_seconds``,
``bytes_per_pack``), and every fault is the collectives' named error (UnavailableError for a gone peer,
DeadlineExceededError for a late one, ValueError for a mismatched call).

Gradient communication plugs in as ``hook(state, bucket) -> torch.futures.Future`` (DDP's comm hooks): the
synchronizer hands each full bucket to the hook and waits on the future at the end of backward. The default
is ``allreduce_hook`` (a SUM in place); ``CompressionHook(torch.float16)`` is another hook.

Example (under torchrun):
    >>> import torch, torchstrategies as ts                                      # doctest: +SKIP
    >>> from torchstrategies.distribute.collective_all_reduce import CollectiveAllReduce, GradBucket
    >>> cao = CollectiveAllReduce(ts.CommunicationOptions(implementation="SHM"))  # doctest: +SKIP
    >>> cao.all_reduce_tensors("sum", [torch.ones(3)])                           # doctest: +SKIP
    >>> fut = allreduce_hook(cao, GradBucket(0, torch.ones(8)))                  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies import collectives
from torchstrategies.collectives import CommunicationOptions
from torchstrategies.collectives.packing import make_packs
from torchstrategies.distribute.cross_device_ops import CrossDeviceOps, _place
from torchstrategies.distribute.values import DistributedValues, local_results
from torchstrategies.reduce_op import ReduceOp

__all__ = ["CollectiveAllReduce", "GradBucket", "Hook", "allreduce_hook", "CompressionHook"]


class GradBucket:
    """What a communication hook receives: one flat gradient buffer (DDP's ``GradBucket``).

    Args:
        index: the bucket's position (buckets are launched in index order on every rank).
        buffer: the flat tensor holding the bucket's gradients (and one 0/1 flag per parameter).
    """

    def __init__(self, index: int, buffer: torch.Tensor) -> None:
        self._index = index
        self._buffer = buffer

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


Hook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _failed(exc: BaseException) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types the argument as the value type
    return fut


def allreduce_hook(state: CollectiveAllReduce, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The default hook: the bucket SUMMED over every worker, in place (the future's value is the buffer)."""
    return state.all_reduce_async(bucket.buffer())


class CompressionHook:
    """A hook that sends each bucket in 16 bits and sums the workers' copies in the bucket's dtype.

    Every rank rounds its bucket once to ``dtype``, the ranks all-gather the 16-bit buffers, and every rank
    sums them in rank order (so all ranks get the same bits). Error bound per element:
    ``|reduced - exact| <= u * sum_i |g_i| + n * 2**-24 * sum_i |g_i| + n * a`` with ``u = 2**-11``
    (float16) or ``2**-8`` (bfloat16) and ``a`` the type's underflow step; float16 overflows beyond 65504.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"compression dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype

    def __call__(self, state: CollectiveAllReduce, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        flat = bucket.buffer()
        try:
            parts = state.all_gather_flat(flat.to(self.dtype))
            flat.copy_(parts[0])
            for p in parts[1:]:
                flat.add_(p)
        except Exception as exc:  # noqa: BLE001 - the future carries it to the waiter
            return _failed(exc)
        return _done(flat)

    def __repr__(self) -> str:
        return f"CompressionHook({self.dtype})"


class CollectiveAllReduce(CrossDeviceOps):
    """Cross-worker reductions over ``torchstrategies.collectives`` (TF's ``CollectiveAllReduce``).

    Args:
        options: the default ``CommunicationOptions`` (a call's own options override its set fields).
        group: the process group (None: the world).
    """

    def __init__(self, options: CommunicationOptions | None = None, group: Any = None) -> None:
        if options is not None and not isinstance(options, CommunicationOptions):
            raise TypeError(f"communication_options must be a ts.CommunicationOptions, got {options!r}")
        self.options = options if options is not None else CommunicationOptions()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # The synchronizer packs buckets itself: ask the collectives for no further splitting.
        self._bucket_options = CommunicationOptions(0, self.options.timeout_seconds, self.options.implementation)

    @property
    def implementation_name(self) -> str:
        return self.options.implementation.name

    def _merged(self, options: Any) -> CommunicationOptions:
        if options is None or not isinstance(options, CommunicationOptions):
            return self.options
        return self.options.merge(options)

    # --- tensors ------------------------------------------------------------------------------------------
    def all_reduce_tensors(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor],
                           options: Any = None) -> list[torch.Tensor]:
        """Returns each tensor reduced over every worker (new tensors; MEAN divides by the world size)."""
        rop = ReduceOp.from_any(op)
        items = [t.detach() for t in tensors]
        if rop is ReduceOp.MEAN:
            for t in items:
                if not (t.is_floating_point() or t.is_complex()):
                    raise ValueError(f"cannot MEAN-reduce an integer tensor of dtype {t.dtype} across workers")
        if not items:
            return []
        return list(collectives.all_reduce(items, rop, group=self.group, options=self._merged(options)))

    def all_reduce_async(self, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """SUMs a flat bucket in place; the future's value is ``flat``. CPU buckets are reduced at once in
        the caller's thread (a background thread would only compete with backward for the same cores)."""
        try:
            if flat.device.type == "cpu":
                collectives.all_reduce_(flat, "sum", group=self.group, options=self._bucket_options)
                return _done(flat)
            fut: torch.futures.Future[torch.Tensor] = collectives.all_reduce_async(
                flat, "sum", group=self.group, options=self._bucket_options)
        except Exception as exc:  # noqa: BLE001 - the future carries it to the waiter
            return _failed(exc)
        return fut

    def all_gather_flat(self, flat: torch.Tensor, options: Any = None) -> list[torch.Tensor]:
        """Every worker's ``flat`` (same size on all), in rank order."""
        out = collectives.all_gather(flat.reshape(-1), group=self.group, options=self._merged(options))
        return list(out.view(self.world_size, -1).unbind(0))

    def gather(self, t: torch.Tensor, axis: int = 0, options: Any = None) -> torch.Tensor:
        """Concatenates every worker's ``t`` along ``axis``; the sizes along ``axis`` may differ."""
        if t.dim() == 0:
            raise ValueError(f"gather needs a tensor of rank >= 1 to concatenate along axis {axis}, got a scalar")
        axis = axis % t.dim()
        x = t.detach().movedim(axis, 0).contiguous()
        opts = self._merged(options)
        sizes = collectives.all_gather(torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device),
                                       group=self.group, options=opts).tolist()
        pad = torch.zeros((max(sizes),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        pad[: x.shape[0]] = x
        parts = collectives.all_gather(pad.unsqueeze(0), group=self.group, options=opts)
        out = torch.cat([parts[i, :k] for i, k in enumerate(sizes)], dim=0)
        return out.movedim(0, axis)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0, options: Any = None) -> None:
        """Overwrites ``tensors`` in place with rank ``src``'s values (packed per dtype/device)."""
        items = [t.detach() for t in tensors]
        opts = self._merged(options)
        for pack in make_packs(items, 0):
            if pack.numel == 0:
                continue
            flat = pack.fill(items, None)
            collectives.broadcast(flat, src, group=self.group, options=opts)
            with torch.no_grad():
                pack.copy_back(items)

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat bucket; on CPU it lives where the implementation reduces it without a copy in."""
        if device.type != "cpu":
            return torch.zeros(numel, dtype=dtype, device=device)
        return collectives.buffer(numel, dtype, group=self.group, options=self._bucket_options)

    # --- CrossDeviceOps -----------------------------------------------------------------------------------
    def batch_reduce_implementation(self, op: ReduceOp, pairs: list[tuple[DistributedValues, tuple[torch.device,
                                    ...]]], options: Any) -> list[Any]:
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
        return f"CollectiveAllReduce({self.options!r})"
