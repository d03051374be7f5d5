"""SHM: all-reduce / broadcast / all-gather through a POSIX shared-memory segment (C++ in csrc/core/shm.*).

One segment per group, created by the group's rank 0 under a unique name ("/torchstrat_<pid>_<hex>")
passed to the others through the c10d store, and unlinked as soon as every rank has mapped it, so
nothing is left in /dev/shm even if a rank dies. Small messages take a one-shot path (every rank sums
all peers' copies, one barrier); large ones a chunked reduce-scatter + all-gather. A list of tensors of
one dtype is reduced in place as one concatenated buffer, without packing (``all_reduce_many_``). A tensor
allocated with ``ShmCommunicator.buffer`` lives in shared memory and is reduced in place without a copy in
(the zero-copy path used for gradient buckets).
"""

from __future__ import annotations

import itertools
import os
import secrets
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies._ext import _C
from torchstrategies.collectives import topology
from torchstrategies.collectives._common import (
    OP_CODES,
    SUPPORTED_DTYPES,
    deadline_error,
    global_missing,
    host_hash,
    peer_error,
    remember_peers,
    wait_work,
)
from torchstrategies.reduce_op import ReduceOp

__all__ = ["ShmCommunicator", "get_communicator", "supported"]

ERRORS = (_C.ShmDeadlineError, _C.ShmMismatchError)  # what the C++ communicator raises for comm faults
SLOT_BYTES = int(os.environ.get("TORCHSTRATEGIES_SHM_SLOT_BYTES", str(4 << 20)))
# One communicator per live group object, held weakly: a destroyed process group must be freed at once
# (see topology), and a new group with the same ranks gets a communicator of its own.
_comms: weakref.WeakKeyDictionary[Any, ShmCommunicator] = weakref.WeakKeyDictionary()
_created: dict[tuple[int, ...], itertools.count] = {}


def supported(group: Any) -> bool:
    """True if every rank of the group is on this host (a collective the first time per group)."""
    hosts = topology.group_hosts(group)
    return len(set(hosts)) == 1


class ShmCommunicator:
    """A shared-memory communicator for one group (all ranks on one host).

    Example:
        >>> comm = get_communicator(None)            # doctest: +SKIP
        >>> buf = comm.buffer(1024, torch.float32)   # lives in shared memory
        >>> comm.all_reduce_(buf, ReduceOp.SUM, 30.0)
    """

    def __init__(self, group: Any, timeout: float) -> None:
        g = topology.resolve(group)
        self.ranks = topology.group_ranks(g)
        self.desc = topology.describe_group(g)
        self.rank = dist.get_rank(g)
        self.world = len(self.ranks)
        key = tuple(self.ranks)
        pids = self._agree_on_settings(g, timeout)
        n = next(_created.setdefault(key, itertools.count()))
        store_key = f"torchstrategies/shm/{'-'.join(map(str, key))}/{n}"
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            name = f"/torchstrat_{os.getpid()}_{secrets.token_hex(6)}"
            # The C++ side unlinks the name once every rank has mapped it, and at exit or on SIGTERM.
            self._c = _C.ShmComm(name, 0, self.world, SLOT_BYTES, True)
            self._c.expect_pids(pids)  # a peer that dies before it maps the segment is noticed in attach
            store.set(store_key, name)
        else:
            try:
                store.wait([store_key], timedelta(seconds=timeout))
            except Exception as exc:  # noqa: BLE001
                raise deadline_error("shm setup", self.desc, timeout, [self.ranks[0]], exc) from exc
            name = store.get(store_key).decode()
            self._c = _C.ShmComm(name, self.rank, self.world, SLOT_BYTES, False)
        self._call("shm setup", timeout, self._c.attach, timeout)

    def _agree_on_settings(self, g: Any, timeout: float) -> list[int]:
        """Exchanges (pid, slot bytes) over the group before any segment exists; returns the pids.

        A rank that is gone fails this exchange (so no segment is made for a group that cannot attach),
        and a TORCHSTRATEGIES_SHM_SLOT_BYTES that differs between ranks raises ValueError on every rank.
        """
        mine = torch.tensor([os.getpid(), SLOT_BYTES], dtype=torch.int64)
        out = torch.zeros((self.world, 2), dtype=torch.int64)
        work = dist.all_gather(list(out.unbind(0)), mine, group=g, async_op=True)
        others = [r for r in self.ranks if r != self.ranks[self.rank]]
        wait_work(work, timeout, "shm setup", self.desc, others)
        rows = out.tolist()
        remember_peers(g, [(host_hash(), int(r[0])) for r in rows])  # one host: every pid is checkable
        slots = [int(r[1]) for r in rows]
        if len(set(slots)) > 1:
            per_rank = ", ".join(f"rank {self.ranks[i]}: {v}" for i, v in enumerate(slots))
            raise ValueError(
                f"shm setup on {self.desc}: TORCHSTRATEGIES_SHM_SLOT_BYTES differs between ranks ({per_rank}); "
                "set the same value on every rank (or leave it unset)"
            )
        return [int(r[0]) for r in rows]

    def _call(self, what: str, timeout: float, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ERRORS as exc:
            self.raise_error(what, timeout, exc)

    def raise_error(self, what: str, timeout: float, exc: BaseException) -> None:
        """Re-raises an error of the C++ communicator (one of ``ERRORS``) as the documented type.

        A late peer is DeadlineExceededError, a gone one (or a group another rank gave up on because a peer
        was gone) UnavailableError, a mismatched call ValueError.
        """
        kind = getattr(exc, "kind", "timeout")
        missing = global_missing(list(getattr(exc, "missing_ranks", [])), self.ranks)
        if isinstance(exc, _C.ShmMismatchError) or kind == "mismatch":
            raise ValueError(f"{what} on {self.desc}: {exc}") from exc
        if kind == "unavailable":
            raise peer_error(what, self.desc, missing, exc) from exc
        if isinstance(exc, _C.ShmDeadlineError):
            raise deadline_error(what, self.desc, timeout, missing, exc) from exc
        raise exc

    def abort(self, timed_out: bool) -> None:
        """Fails the group on every rank at once (a later stage of a collective failed on this rank)."""
        self._c.abort(timed_out)

    def all_reduce_(self, t: torch.Tensor, op: ReduceOp, timeout: float) -> torch.Tensor:
        """Reduces a contiguous CPU tensor in place (zero-copy if it came from ``buffer``)."""
        self._call("all_reduce", timeout, self._c.all_reduce_, t, OP_CODES[op], timeout)
        return t

    def kernel(self, op: ReduceOp, timeout: float) -> Callable[[torch.Tensor], None]:
        """The hot path's in-place all-reduce of one contiguous CPU tensor, bound to ``op`` and ``timeout``
        (what a ``Plan`` runs; errors are raised as ``all_reduce_`` raises them)."""
        reduce, code, raise_error = self._c.all_reduce_, OP_CODES[op], self.raise_error

        def run(t: torch.Tensor) -> None:
            try:
                reduce(t, code, timeout)
            except ERRORS as exc:
                raise_error("all_reduce", timeout, exc)

        return run

    def all_reduce_many_(self, ts: list[torch.Tensor], op: ReduceOp, timeout: float) -> list[torch.Tensor]:
        """Reduces contiguous CPU tensors of one dtype in place, as one concatenated buffer (no packing)."""
        self._call("all_reduce", timeout, self._c.all_reduce_many_, ts, OP_CODES[op], timeout)
        return ts

    def broadcast_(self, t: torch.Tensor, src: int, timeout: float) -> torch.Tensor:
        """Copies group rank ``src``'s tensor into every rank's ``t``."""
        self._call("broadcast", timeout, self._c.broadcast_, t, src, timeout)
        return t

    def all_gather(self, t: torch.Tensor, timeout: float) -> torch.Tensor:
        """Returns a tensor of shape (world, *t.shape) holding every rank's ``t``."""
        out = torch.empty((self.world, *t.shape), dtype=t.dtype)
        self._call("all_gather", timeout, self._c.all_gather, t, out, timeout)
        return out

    def buffer(self, numel: int, dtype: torch.dtype, timeout: float = 300.0) -> torch.Tensor:
        """A 1-D tensor in shared memory (collective: every rank calls with the same arguments)."""
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"shm buffer: unsupported dtype {dtype}")
        return self._call("alloc_buffer", timeout, self._c.alloc_buffer, numel, torch.empty(0, dtype=dtype), timeout)

    def owns(self, t: torch.Tensor) -> bool:
        """True if ``t`` lies in a buffer of this communicator (then all_reduce_ is zero-copy)."""
        return bool(self._c.in_buffer(t))

    @property
    def broken(self) -> bool:
        return bool(self._c.broken)

    @property
    def slot_bytes(self) -> int:
        """Bytes per staging slot (TORCHSTRATEGIES_SHM_SLOT_BYTES rounded up to the page size)."""
        return int(self._c.slot_bytes)

    @property
    def name(self) -> str:
        return str(self._c.name)


def get_communicator(group: Any, timeout: float) -> ShmCommunicator:
    """The cached communicator of ``group`` (created collectively on first use)."""
    key = topology.resolve(group)
    comm = _comms.get(key)
    if comm is not None and comm.broken:
        raise RuntimeError(
            f"the shared-memory communicator of {comm.desc} failed earlier (timeout, dead peer or "
            "mismatched call) and cannot be used again; create a new process group"
        )
    if comm is None:
        comm = ShmCommunicator(group, timeout)
        _comms[key] = comm
    return comm


def clear() -> None:
    """Drops cached communicators (their segments are unmapped when the last buffer dies)."""
    _comms.clear()
