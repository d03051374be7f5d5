"""The per-rank phases of ``bench allreduce --hosts``: bytes on the link per call, and the link's round trip.

Run by ``allreduce_worker`` when it is given ``--iface`` (each rank inside its host's namespace,
``bench/netns.py``). :func:`link_bytes`: per case, after the timed rounds, the lowest rank of each host reads
its interface's counters (``/proc/net/dev``, which shows this process's namespace), a barrier, every rank
makes ``calls`` calls, a barrier, the counters again; the result is each host's bytes sent and received per
call, as the veth counts them (frames: payload, headers, ACKs, and two barriers' few hundred bytes spread
over the calls), and the batch's time per call (the slowest rank's; calls back to back).
:func:`round_trip`: rank 0 and the lowest rank of another host ping-pong one byte over TCP on their own
addresses; the median of 50 is the link's round-trip time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

__all__ = ["interface_bytes", "link_bytes", "round_trip", "calls_for"]

Call = Callable[[], object]


def interface_bytes(iface: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``iface`` in this process's network namespace.

    Raises:
        ValueError: no such interface here (names it and the ones there are).
    """
    with open("/proc/net/dev") as f:
        lines = f.read().splitlines()[2:]
    names = []
    for line in lines:
        name, _, rest = line.partition(":")
        names.append(name.strip())
        if name.strip() == iface:
            v = rest.split()
            return int(v[8]), int(v[0])
    raise ValueError(f"no interface {iface!r} in this namespace (there are {names})")


def calls_for(nbytes: int) -> int:
    """Calls per counted case: about 16 MiB of messages, 1 to 20 calls."""
    return max(1, min(20, (16 << 20) // max(nbytes, 1)))


def link_bytes(iface: str, hosts: list[str], cases: list[tuple[int, str]],
               prepare: dict[tuple[int, str], Callable[[], Call]]) -> list[dict[str, object]]:
    """Per case: ``calls`` calls counted on every host's interface; rank 0 gets every host's tx/rx per call.

    Collective: every rank calls it with the same cases.
    """
    rank = dist.get_rank()
    leader = hosts.index(hosts[rank]) == rank
    out = []
    for nbytes, impl in cases:
        fn = prepare[(nbytes, impl)]()
        k = calls_for(nbytes)
        dist.barrier()  # the previous case's traffic is over
        before = interface_bytes(iface) if leader else (0, 0)
        dist.barrier()  # every leader has read its counters before any rank sends
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        seconds = time.perf_counter() - t0
        dist.barrier()
        after = interface_bytes(iface) if leader else (0, 0)
        mine = (hosts[rank], after[0] - before[0], after[1] - before[1]) if leader else None
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, seconds))
        per_host = {str(g[0][0]): (g[0][1] / k, g[0][2] / k) for g in gathered if isinstance(g, tuple) and g[0]}
        batch = max(float(g[1]) for g in gathered if isinstance(g, tuple)) / k
        out.append({"size": nbytes, "implementation": impl, "calls": k, "batch_seconds_per_call": batch,
                    "tx_per_call": {h: v[0] for h, v in per_host.items()},
                    "rx_per_call": {h: v[1] for h, v in per_host.items()}})
    return out


def round_trip(hosts: list[str], address: str, pings: int = 50) -> float | None:
    """Median seconds of a one-byte TCP ping-pong between rank 0 and the lowest rank of another host (on
    their own addresses); None with one host. Collective."""
    rank = dist.get_rank()
    others = [r for r, h in enumerate(hosts) if h != hosts[0]]
    result: list[object] = [None]
    if others:
        peer = others[0]
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            with socket.create_server((address, 0)) as srv:
                store.set("bench/rtt", f"{address}:{srv.getsockname()[1]}")
                srv.settimeout(60)
                conn, _ = srv.accept()
                with conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    for _ in range(pings + 5):
                        conn.sendall(conn.recv(1))
        elif rank == peer:
            store.wait(["bench/rtt"], timedelta(seconds=60))
            host, port = store.get("bench/rtt").decode().rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=60) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ts = []
                for i in range(pings + 5):
                    t0 = time.perf_counter()
                    c.sendall(b"x")
                    c.recv(1)
                    if i >= 5:
                        ts.append(time.perf_counter() - t0)
            ts.sort()
            result = [ts[len(ts) // 2]]
        dist.broadcast_object_list(result, src=peer)
    return result[0] if isinstance(result[0], float) else None


def own_address() -> str:
    """The address this rank binds (the launcher sets TORCHSTRATEGIES_RING_ADDR per namespace)."""
    return os.environ.get("TORCHSTRATEGIES_RING_ADDR", "127.0.0.1")
