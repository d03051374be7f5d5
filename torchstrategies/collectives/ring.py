"""RING: bandwidth-optimal all-reduce (reduce-scatter + all-gather) over TCP, in C++ (csrc/core/ring.*).

One ``RingCommunicator`` per group, made collectively on first use: every rank listens on its own interface
address (``TORCHSTRATEGIES_RING_ADDR``, else the source address of the route to ``MASTER_ADDR``; port 0, never
a wildcard), publishes ``host port nonce pid host-hash`` in the process group's store, connects to its right
neighbour and accepts its left one (the hello carries rank, group id and the acceptor's nonce, so a stray
connection is refused). Each call's 64-byte descriptor (sequence number, op, dtype, count and the settings
below) travels with its first data, so a mismatched call raises ValueError on every rank without an extra
round: the rank that sees it publishes the message in the store and closes its connections, the others see
the connection close and read the message.

Settings (every rank must use the same values; they are part of the descriptor):
    TORCHSTRATEGIES_RING_SMALL_BYTES: messages up to this size are all-gathered whole and reduced on every
        rank (for 2 ranks: one exchange); larger ones take the ring.
    TORCHSTRATEGIES_RING_CHUNK_BYTES: the staging buffer that received bytes are reduced from.
Per rank: TORCHSTRATEGIES_RING_SOCKET_BYTES (SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's autotuning) and
TORCHSTRATEGIES_RING_THREAD_BYTES (calls sending at least this many bytes write from a second thread; 4 MiB).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import socket
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies._ext import _C
from torchstrategies.collectives import topology
from torchstrategies.collectives._common import (
    deadline_error,
    diagnose,
    host_hash,
    peer_error,
    remember_peers,
    report_fault,
    reported_fault,
)
from torchstrategies.reduce_op import ReduceOp

__all__ = ["all_reduce_", "RingCommunicator", "get_communicator", "bind_address", "preferred", "clear"]

SMALL_BYTES = int(os.environ.get("TORCHSTRATEGIES_RING_SMALL_BYTES", str(64 << 10)))
CHUNK_BYTES = int(os.environ.get("TORCHSTRATEGIES_RING_CHUNK_BYTES", str(256 << 10)))
SOCKET_BYTES = int(os.environ.get("TORCHSTRATEGIES_RING_SOCKET_BYTES", "0"))
OP_CODES: dict[ReduceOp, int] = {op: int(_C.RING_OP_CODES[op.name]) for op in ReduceOp}
_OP_NAMES = {v: k for k, v in _C.RING_OP_CODES.items()}
_SETTINGS_HINT = (" (settings: TORCHSTRATEGIES_RING_SMALL_BYTES and TORCHSTRATEGIES_RING_CHUNK_BYTES must be the "
                  "same on every rank)")

# Message sizes (bytes, per all-reduce; [lo, hi) ranges) where the ring beat gloo's all_reduce: ws=2 over
# loopback TCP, `torchstrategies bench allreduce` (interleaved rounds, medians) and the full table of
# benchmarks/allreduce.py, on a quiet 2-core machine (docs/collectives.md, RING): ahead at every size measured
# (4 KiB to 64 MiB; 14-22x at 4 KiB, 1.45-1.67x at 64 MiB), so the range is open above. AUTO picks RING
# between hosts, and HIERARCHICAL between host leaders, in it.
MEASURED_FASTER: tuple[tuple[int, int], ...] = ((0, 1 << 40),)

_comms: weakref.WeakKeyDictionary[Any, RingCommunicator] = weakref.WeakKeyDictionary()
# How many rings each group has had in this process: the n-th ring's store keys carry n. Every rank agrees on
# n because a ring fails on every rank exactly once (a failing rank closes its connections, so the others'
# next call on it fails too; a call that has sent everything waits only on its left neighbour, so a ring
# closed over a later call does not fail an earlier one), and each failure is followed by one new ring.
_created: dict[tuple[int, ...], itertools.count] = {}


def preferred(nbytes: int) -> bool:
    """True if the shipped measurement shows the ring faster than gloo for an all-reduce of ``nbytes``."""
    return any(lo <= nbytes < hi for lo, hi in MEASURED_FASTER)


def bind_address() -> str:
    """This rank's numeric address to listen on: TORCHSTRATEGIES_RING_ADDR, else the source address of the
    route to MASTER_ADDR (loopback if the master is local), else the hostname's address."""
    named = os.environ.get("TORCHSTRATEGIES_RING_ADDR")
    if named:
        try:
            return str(socket.getaddrinfo(named, None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            raise ValueError(f"TORCHSTRATEGIES_RING_ADDR={named!r} does not resolve: {exc}") from exc
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            fam, _, _, _, sa = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)[0]
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect((sa[0], int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class RingCommunicator:
    """The TCP ring of one group (collective set-up: every rank of the group creates it in the same order)."""

    def __init__(self, group: Any, timeout: float) -> None:
        g = topology.resolve(group)
        self._group = weakref.ref(g)  # weak: the cache is keyed by the group, which must be able to go
        self.ranks = topology.group_ranks(g)
        self.desc = topology.describe_group(g)
        self.rank = dist.get_rank(g)
        self.world = len(self.ranks)
        key = tuple(self.ranks)
        n = next(_created.setdefault(key, itertools.count()))
        self.prefix = f"torchstrategies/ring/{'-'.join(map(str, key))}/{n}"
        self.store = dist.distributed_c10d._get_default_store()
        gid = int.from_bytes(hashlib.blake2b(self.prefix.encode(), digest_size=8).digest(), "little")
        nonce = secrets.randbits(63)
        addr = bind_address()
        self._c = _C.RingComm(self.rank, self.world, gid, SOCKET_BYTES, True)
        port = self._c.listen(addr)
        self.store.set(f"{self.prefix}/addr/{self.rank}", f"{addr} {port} {nonce} {os.getpid()} {host_hash()}")
        keys = [f"{self.prefix}/addr/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - the store reports a timeout as RuntimeError
            self._c.close()
            missing = [self.ranks[r] for r in range(self.world) if not self._has(keys[r])]
            raise deadline_error("all_reduce(ring) setup", self.desc, timeout, missing, exc) from exc
        rows = [self.store.get(k).decode().split() for k in keys]
        remember_peers(g, [(int(r[4]), int(r[3])) for r in rows])
        right = rows[(self.rank + 1) % self.world]
        self._call("all_reduce(ring) setup", timeout, self._c.establish, right[0], int(right[1]), int(right[2]),
                   nonce, timeout)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001
            return False

    def _call(self, what: str, timeout: float, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _C.RingError as exc:
            self._raise(what, timeout, exc)

    def all_reduce_(self, t: torch.Tensor, op: ReduceOp, timeout: float) -> torch.Tensor:
        """Reduces a contiguous CPU tensor in place (MEAN is scaled here)."""
        try:
            self._c.all_reduce_(t, OP_CODES[op], SMALL_BYTES, CHUNK_BYTES, timeout)
        except _C.RingError as exc:
            self._raise("all_reduce(ring)", timeout, exc)
        return t

    @property
    def broken(self) -> bool:
        return bool(self._c.broken)

    def _raise(self, what: str, timeout: float, exc: Any) -> None:
        """Re-raises a RingError as ValueError (mismatch), UnavailableError (gone) or DeadlineExceededError."""
        kind, peer = exc.kind, int(exc.peer)
        mkey = f"{self.prefix}/mismatch"
        if kind == "mismatch":
            msg = self._mismatch_message(exc.mine, exc.theirs)
            try:
                self.store.set(mkey, msg)
            finally:
                self._c.close()  # the peers see the connection close, then read the message
            raise ValueError(msg) from None
        self._c.close()
        if self._has(mkey):
            raise ValueError(self.store.get(mkey).decode()) from None
        named = self.ranks[peer] if 0 <= peer < self.world else None
        group = self._group()
        gone, stopped = diagnose(group)
        for _ in range(10 if kind == "unavailable" and not gone else 0):
            time.sleep(0.05)  # a closed connection can be seen while the peer is still exiting
            gone, stopped = diagnose(group)
            if gone or self._has(mkey):
                break
        if self._has(mkey):
            raise ValueError(self.store.get(mkey).decode()) from None
        if gone:
            report_fault(group, gone[0])
            raise peer_error(what, self.desc, gone, f"process gone; {exc}") from exc
        if stopped:
            raise deadline_error(what, self.desc, timeout, stopped, f"process stopped; {exc}") from exc
        seen = reported_fault(group) if group is not None else None
        if seen is not None and seen[0] != named:
            raise peer_error(what, self.desc, [seen[0]], f"rank {seen[1]} reported it gone; {exc}") from exc
        who = [named] if named is not None else None
        if kind == "timeout":
            raise deadline_error(what, self.desc, timeout, who, exc) from exc
        if named is not None and kind == "unavailable" and group is not None:
            report_fault(group, named)
        raise peer_error(what, self.desc, who, exc) from exc

    def _mismatch_message(self, mine: dict, theirs: dict) -> str:
        def fmt(h: dict) -> str:
            return (f"all_reduce(ring)#{h['seq']}(op={_OP_NAMES.get(h['op'], h['op'])}, dtype={h['dtype']}, "
                    f"numel={h['count']}, setting=small {h['small_bytes']}/chunk {h['chunk_bytes']})")

        fields = [("seq", "seq"), ("op", "op"), ("dtype", "dtype"), ("count", "numel")]
        diff = [name for f, name in fields if mine[f] != theirs[f]]
        if (mine["small_bytes"], mine["chunk_bytes"]) != (theirs["small_bytes"], theirs["chunk_bytes"]):
            diff.append("setting")
        me, left = self.ranks[self.rank], self.ranks[int(theirs["rank"])]
        a, b = sorted([(left, theirs), (me, mine)], key=lambda x: x[0])
        hint = _SETTINGS_HINT if "setting" in diff else ""
        return (f"collective mismatch on {self.desc}: rank {a[0]} called {fmt(a[1])} but rank {b[0]} called "
                f"{fmt(b[1])} (differs in {', '.join(diff)}){hint}")


def get_communicator(group: Any, timeout: float) -> RingCommunicator:
    """The cached ring of ``group``; a failed one (mismatch, dead or late peer) is replaced collectively."""
    key = topology.resolve(group)
    comm = _comms.get(key)
    if comm is None or comm.broken:
        comm = _comms[key] = RingCommunicator(group, timeout)
    return comm


def all_reduce_(t: torch.Tensor, op: ReduceOp, group: Any, timeout: float) -> torch.Tensor:
    """In-place ring all-reduce of a contiguous tensor (MEAN is divided here; CUDA tensors go through the CPU)."""
    if dist.get_world_size(group) == 1:
        return t
    comm = get_communicator(group, timeout)
    if t.is_cuda:
        host = t.cpu()
        comm.all_reduce_(host, op, timeout)
        t.copy_(host)
        return t
    return comm.all_reduce_(t, op, timeout)


def clear() -> None:
    """Drops cached communicators (their connections close)."""
    _comms.clear()
