"""The per-rank side of ``torchstrategies bench allreduce``; launched by torchrun, never imported.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m torchstrategies.bench.allreduce_worker --json out.json

Every rank times the same calls back to back; the time of a call is the slowest rank's median. With
``--rounds R`` every case is timed once per round, the cases interleaved, and the median over the rounds
is reported: a burst of load from other jobs then hits one round of every row, not one row.
Rows: one per (size, implementation); "shm", "ring", "hierarchical", "auto" go through our API
(``collectives.all_reduce_`` on the gloo world, which runs on a "torchstrategies" backend made over its ranks);
"dist-backend" is ``dist.all_reduce`` on a process group made with ``dist.new_group(backend="torchstrategies")``
(AUTO), i.e. what DDP and FSDP call; "shm-zero-copy" reduces a buffer that already lives in the shared segment
(``collectives.buffer``); "shm-comm" calls the shared-memory communicator (``_C.ShmComm``) directly from
Python, on this thread, with no backend, queue or API in between: the floor the others are compared with;
"loopback-roofline" is raw TCP bytes between the ranks (``bench/loopback.py``). When an SHM row is selected,
also the packed case: 100 tensors of 10k floats in one packed all-reduce vs 100 gloo calls.

Before every timed case (every round) each implementation reduces a known pattern once and the result is
compared with the exact sum on every rank (the roofline compares the received bytes with what its left
neighbour sent): a wrong result stops the run with a RuntimeError naming the implementation, the size
and the ranks, so no wrong implementation's time is ever reported. ``--simulate-hosts H`` sets
``TORCHSTRATEGIES_HOST_ID`` per rank (ranks ``[k*n/H, (k+1)*n/H)`` on ``simulated-host-k``) before the process
group exists, so HIERARCHICAL runs SHM inside a simulated host and its inter-host stage between them.
With ``--iface NAME`` (``bench allreduce --hosts``: every rank in its host's network namespace) the bytes each
host's interface carries per call, and the link's round trip, are measured after the rounds
(``bench/allreduce_link.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from torchstrategies import collectives as C
from torchstrategies._ext import _C
from torchstrategies.bench.loopback import LoopbackRing, ring_bytes
from torchstrategies.bench.report import median
from torchstrategies.collectives import topology
from torchstrategies.collectives.backend import shm_slot_bytes  # the backend's slots: the same algorithm
from torchstrategies.strategies._mw_cluster import import_dynamo_first

ROOFLINE = "loopback-roofline"
SHM_IMPLS = ("shm", "shm-comm", "shm-zero-copy")
IMPLS = ["gloo", *SHM_IMPLS, "dist-backend", "ring", "hierarchical", "auto", ROOFLINE]


def _iters(nbytes: int) -> int:
    return int(min(300, max(5, 2e8 // max(nbytes, 1) // 4)))


WARMUP_S = 0.05  # warm-up per case: long enough for the scheduler to settle the ranks after the last case


def _time(fn: Callable[[], object], iters: int) -> float:
    # Warm up for at least 10 calls and about WARMUP_S seconds, the same for every implementation: right after
    # another case (gloo's threads, a large message) both ranks can share one core for a while. The calls are
    # collectives, so the ranks agree on the count (the largest any rank needs).
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    per_call = (time.perf_counter() - t0) / 3
    need = torch.tensor([max(10, int(WARMUP_S / max(per_call, 1e-7)))], dtype=torch.int64)
    dist.all_reduce(need, op=dist.ReduceOp.MAX)
    for _ in range(min(int(need.item()), 100_000)):
        fn()
    dist.barrier()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    med = torch.tensor([ts[len(ts) // 2]], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


_SHM_COMM: list = []


def _shm_comm() -> object:
    """The shared-memory communicator of the world, made here directly (collective; one per run)."""
    if not _SHM_COMM:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            name = f"/torchstrat_bench_{os.getpid()}"
            comm = _C.ShmComm(name, 0, world, shm_slot_bytes(), True)
            store.set("bench/shm", name)
        else:
            store.wait(["bench/shm"], timedelta(seconds=60))
            comm = _C.ShmComm(store.get("bench/shm").decode(), rank, world, shm_slot_bytes(), False)
        comm.attach(60.0)  # rank 0 unlinks the name once every rank has mapped it
        _SHM_COMM.append(comm)
    return _SHM_COMM[0]


_BACKEND_GROUP: list = []


def _call(impl: str, t: torch.Tensor) -> Callable[[], object]:
    if impl == "gloo":
        return lambda: dist.all_reduce(t)
    if impl == "shm-comm":
        comm = _shm_comm()
        reduce = comm.all_reduce_  # type: ignore[attr-defined]
        sum_code = int(_C.REDUCE_OP_CODES["SUM"])
        return lambda: reduce(t, sum_code, 300.0)
    if impl == "dist-backend":
        if not _BACKEND_GROUP:
            _BACKEND_GROUP.append(dist.new_group(backend="torchstrategies", timeout=timedelta(seconds=300)))
        group = _BACKEND_GROUP[0]
        return lambda: dist.all_reduce(t, group=group)
    name = {"shm": "SHM", "shm-zero-copy": "SHM", "ring": "RING", "auto": "AUTO",
            "hierarchical": "HIERARCHICAL"}[impl]
    opts = C.CommunicationOptions(implementation=name, timeout_seconds=300)
    return lambda: C.all_reduce_(t, options=opts)


def _agree(what: str, problem: str | None) -> None:
    """Raises RuntimeError on every rank if ``problem`` is set on any (a collective: every rank calls it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world, dtype=torch.int32)
    flags[rank] = int(problem is not None)
    dist.all_reduce(flags)
    bad = flags.nonzero().flatten().tolist()
    if bad:
        mine = f"; on rank {rank}: {problem}" if problem else ""
        raise RuntimeError(f"{what} gave a wrong result on ranks {bad}{mine}")


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    if torch.equal(got, expected):
        return None
    diff = got.ne(expected).nonzero()
    i = int(diff[0, 0])
    return f"{diff.shape[0]} of {got.numel()} elements differ, first at {i}: got {got[i].item()}, " \
           f"expected {expected[i].item()}"


def _check_all_reduce(impl: str, nbytes: int, t: torch.Tensor, fn: Callable[[], object]) -> None:
    """One call on a known pattern (small integers, exact in float32), compared with the exact sum."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = _periodic(torch.arange(13, dtype=t.dtype), t.numel())
    t.copy_(base + rank)
    fn()
    expected = base * world + world * (world - 1) // 2
    _agree(f"all-reduce '{impl}' of {nbytes} bytes", _first_difference(t, expected))


def _periodic(period: torch.Tensor, n: int) -> torch.Tensor:
    """``period`` repeated to ``n`` elements (no int64 index tensor of length n: 64 MiB stays 64 MiB)."""
    return period.repeat(-(-n // period.numel()))[:n].contiguous()


def _pattern(nbytes: int, rank: int) -> torch.Tensor:
    """Bytes that differ per rank and per position (period 251, a prime), for the roofline's check."""
    return _periodic(((torch.arange(251) * 31 + rank * 7) % 251).to(torch.uint8), nbytes)


class _Roofline:
    """The roofline case of one size: send/receive buffers and the exchange, checked once per round."""

    def __init__(self, ring: LoopbackRing, nbytes: int) -> None:
        self.ring, self.nbytes = ring, nbytes
        moved = ring_bytes(nbytes, ring.world)
        self.send_t = _pattern(moved, ring.rank)
        self.recv_t = torch.zeros(moved, dtype=torch.uint8)
        self.expected = _pattern(moved, ring.left)
        self.send = self.send_t.numpy().data.cast("B")
        self.recv = self.recv_t.numpy().data.cast("B")

    def __call__(self) -> None:
        self.ring.exchange(self.send, self.recv)

    def check(self) -> None:
        self.recv_t.zero_()
        self()
        _agree(f"{ROOFLINE} of {self.nbytes} bytes", _first_difference(self.recv_t, self.expected))


def _simulate_hosts(hosts: int) -> None:
    """Sets this rank's TORCHSTRATEGIES_HOST_ID from torchrun's RANK/WORLD_SIZE (before any group exists)."""
    if hosts <= 1:
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % hosts:
        raise ValueError(f"--simulate-hosts {hosts} must divide the world size {world}")
    os.environ["TORCHSTRATEGIES_HOST_ID"] = f"simulated-host-{rank // (world // hosts)}"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--simulate-hosts", type=int, default=1)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--iface", default="", help="count this interface's bytes per call (bench allreduce --hosts)")
    return p.parse_args()


Case = tuple[int, str]


Call = Callable[[], object]


def _cases(cases: list[Case], ring: LoopbackRing | None) -> tuple[dict[Case, Callable[[], Call]], dict[Case, Call]]:
    """Per case: ``prepare()``, which readies the case's data and returns the call to time, and the check.
    One tensor per case for every round (zero-copy buffers are not reclaimed one by one), refilled with ones
    before every timing."""
    prepare: dict[Case, Callable[[], Call]] = {}
    checks: dict[Case, Call] = {}
    for nbytes, impl in cases:
        if impl == ROOFLINE:
            assert ring is not None
            roofline = _Roofline(ring, nbytes)
            prepare[(nbytes, impl)], checks[(nbytes, impl)] = functools.partial(_same, roofline), roofline.check
            continue
        n = nbytes // 4
        t = C.buffer(n, torch.float32) if impl == "shm-zero-copy" else torch.zeros(n)
        fn = _call(impl, t)
        prepare[(nbytes, impl)] = functools.partial(_refilled, t, fn)
        checks[(nbytes, impl)] = functools.partial(_check_all_reduce, impl, nbytes, t, fn)
    return prepare, checks


def _same(fn: Call) -> Call:
    return fn


def _refilled(t: torch.Tensor, fn: Call) -> Call:
    t.fill_(1.0)
    return fn


def _packed_round(grads: list[torch.Tensor], out: dict[str, list[float]]) -> None:
    """One round of the packed case: 100 x 10k floats as 100 gloo calls vs one packed SHM / GLOO call."""
    out["gloo-100-calls"].append(_time(lambda: [dist.all_reduce(g) for g in grads], 20))
    for name in ("SHM", "GLOO"):
        opts = C.CommunicationOptions(implementation=name, timeout_seconds=300)
        out[name.lower()].append(_time(functools.partial(C.all_reduce_, grads, options=opts), 20))


def _progress(enabled: bool, round_: int, labels: list[str], label: str) -> None:
    if enabled:
        print(f"PROGRESS {round_ * len(labels) + labels.index(label) + 1} {label}", flush=True)


def main() -> None:
    a = _parse()
    _simulate_hosts(a.simulate_hosts)
    import_dynamo_first()   # before the group: else its gloo threads may abort the exit (_mw_cluster.py)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[object] = [None] * world
    dist.all_gather_object(hosts, topology.host_id())
    impls = [s for s in a.impls.split(",") if s and (s != ROOFLINE or world >= 2)]
    cases = [(int(s), i) for s in a.sizes.split(",") if s for i in impls]
    rounds = max(1, a.rounds)
    packed_case = any(i in SHM_IMPLS for i in impls)
    ring = LoopbackRing(dist.distributed_c10d._get_default_store(), rank, world) if ROOFLINE in impls else None
    prepare, checks = _cases(cases, ring)
    per_case: dict[Case, list[float]] = {c: [] for c in cases}
    grads = [torch.ones(10_000) for _ in range(100)]
    packed_rounds: dict[str, list[float]] = {"gloo-100-calls": [], "shm": [], "gloo": []}
    labels = [f"{impl}@{nbytes}" for nbytes, impl in cases] + (["packed"] if packed_case else [])
    for r in range(rounds):
        for nbytes, impl in cases:
            checks[(nbytes, impl)]()
            per_case[(nbytes, impl)].append(_time(prepare[(nbytes, impl)](), _iters(nbytes)))
            _progress(a.progress and rank == 0, r, labels, f"{impl}@{nbytes}")
        if packed_case:
            _packed_round(grads, packed_rounds)
            _progress(a.progress and rank == 0, r, labels, "packed")
    rows = [{"size": nbytes, "implementation": impl, "seconds": median(per_case[(nbytes, impl)]),
             "rounds": per_case[(nbytes, impl)]} for nbytes, impl in cases]
    packed = {k: median(v) for k, v in packed_rounds.items()} if packed_case else None
    hier_hosts = hier_plan = None
    if "hierarchical" in impls:  # what the backend made for HIERARCHICAL: its plan and how many hosts it saw
        target = C.api._target(None, C.CommunicationImplementation.HIERARCHICAL, False)
        hier_plan, hier_hosts = _C.backend_plan(target.obj)
    link = rtt = None
    if a.iface:  # each rank in its host's namespace (bench/allreduce_hosts.py): bytes on the link, round trip
        from torchstrategies.bench.allreduce_link import link_bytes, own_address, round_trip

        link = link_bytes(a.iface, [str(h) for h in hosts], [c for c in cases if c[1] != ROOFLINE], prepare)
        rtt = round_trip([str(h) for h in hosts], own_address())
    if ring is not None:
        ring.close()
    if rank == 0:
        with open(a.json, "w") as f:
            json.dump({"world": world, "rows": rows, "packed": packed, "rounds": rounds, "hosts": hosts,
                       "hierarchical_hosts": hier_hosts, "hierarchical_plan": hier_plan,
                       "socket_buffer_bytes": ring.buffer_bytes if ring is not None else None,
                       "torch": torch.__version__, "cpus": os.cpu_count(), "link": link, "rtt_seconds": rtt}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
