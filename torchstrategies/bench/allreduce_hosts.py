"""``torchstrategies bench allreduce --hosts N --link RATE``: the all-reduce between hosts, on real links.

Each host is a network namespace with one veth into a switch, rate-limited by ``tc tbf`` in both directions
(``bench/netns.py``; a userspace hub adds a one-way delay with ``--delay-ms``). ``nproc / hosts`` ranks run
in each namespace (consecutive ranks per host), each launched directly with its own address:
``TORCHSTRATEGIES_HOST_ID`` names its host (so the backend knows which ranks share one),
``TORCHSTRATEGIES_RING_ADDR`` is its namespace's address (the ring listens there), ``GLOO_SOCKET_IFNAME`` the
link (gloo binds there), and the c10d store runs on host 0's address. The worker is ``bench allreduce``'s
own (``allreduce_worker``: every case's sum checked on every rank, interleaved rounds, the slowest rank's
median), plus, per case, the bytes each host's veth counted per call and the link's round trip
(``bench/allreduce_link.py``).

Columns: nccl-tests' algbw and busbw (``busbw = algbw * 2(n-1)/n``), the speed-up over gloo, busbw as a
fraction of the line rate, the bytes each host sent per call (veth counter, mean over hosts) against the
theory of the plan (:func:`link_theory`), and, for small messages, the time per call of calls back to back
over the measured round trip.

Example (as root):
    >>> from torchstrategies.bench import allreduce_hosts
    >>> r = allreduce_hosts.run(hosts=2, nproc=4, link="1gbit", sizes=[1 << 20])    # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torchstrategies.bench.allreduce import busbw, machine, size_label
from torchstrategies.bench.hosts_launch import run_job_across_hosts
from torchstrategies.bench.netns import IFACE, parse_rate
from torchstrategies.bench.report import BenchResult

__all__ = ["run", "link_theory", "DEFAULT_SIZES", "DEFAULT_IMPLEMENTATIONS", "IMPLEMENTATIONS", "COLUMNS"]

DEFAULT_SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]
DEFAULT_IMPLEMENTATIONS = ["gloo", "ring", "hierarchical"]
IMPLEMENTATIONS = ["gloo", "ring", "hierarchical", "auto", "dist-backend"]
COLUMNS = ["size", "implementation", "median_us", "algbw_GBps", "busbw_GBps", "speedup_vs_gloo",
           "fraction_of_line_rate", "link_bytes_per_host", "link_theory", "link_vs_theory", "latency_vs_rtt"]
SMALL_SIZE = 64 << 10  # latency_vs_rtt is shown up to this size (beyond it the link's rate, not its delay, counts)


def link_theory(impl: str, size: int, hosts: int, ranks_per_host: int, small_bytes: int | None = None
                ) -> float | None:
    """Payload bytes each host sends over its link per all-reduce of ``size`` bytes; None for gloo (its
    algorithm is its own).

    A ring all-reduce of n members sends ``2(n-1)/n * size`` from every member to the next; a message of at
    most ``small_bytes`` (``TORCHSTRATEGIES_RING_SMALL_BYTES``, 64 KiB) is all-gathered whole instead:
    ``(n-1) * size``. RING's members are all ranks in order, so with consecutive ranks per host exactly one
    edge leaves each host, with n = every rank. HIERARCHICAL's ring has one leader per host (the rest stays in
    shared memory): n = H, once per host, whatever the ranks per host. AUTO (and dist-backend) picks
    HIERARCHICAL when a host has several ranks, else RING.

    >>> link_theory("ring", 1 << 20, 2, 2) / (1 << 20), link_theory("hierarchical", 1 << 20, 2, 2) / (1 << 20)
    (1.5, 1.0)
    >>> link_theory("ring", 4096, 4, 1) / 4096
    3.0
    """
    if small_bytes is None:
        small_bytes = int(os.environ.get("TORCHSTRATEGIES_RING_SMALL_BYTES") or 64 << 10)
    if impl == "gloo" or hosts < 2:
        return None if impl == "gloo" else 0.0
    plan = impl
    if impl in ("auto", "dist-backend"):
        plan = "hierarchical" if ranks_per_host > 1 else "ring"
    members = hosts if plan == "hierarchical" else hosts * ranks_per_host
    if size <= small_bytes:
        return float((members - 1) * size)
    return 2 * (members - 1) / members * size


def run(hosts: int, nproc: int | None = None, link: str | int = "1gbit", sizes: Sequence[int] = DEFAULT_SIZES,
        implementations: Sequence[str] | None = None, rounds: int = 3, delay_ms: float = 0.0,
        progress: bool = True, timeout: float = 1800.0) -> BenchResult:
    """Makes the hosts and links, runs the all-reduce bench across them, deletes them; see the module docs.

    Args:
        hosts: namespaces ("hosts"), 2 to 16.
        nproc: ranks in all, a multiple of ``hosts`` (default: one per host).
        link: each host's link rate per direction, tc's spelling ("1gbit", "10gbit", "500mbit").
        sizes: message sizes in bytes (float32).
        implementations: rows among IMPLEMENTATIONS (gloo always added). Default DEFAULT_IMPLEMENTATIONS.
        rounds: interleaved rounds; the median over them is reported.
        delay_ms: one-way delay added in the switch (a userspace hub; meant for small messages).
        progress: a progress bar on stderr.
        timeout: seconds before the ranks are killed.

    Raises:
        ValueError: a bad argument (names the value).
        netns.NetworkUnavailable: namespaces cannot be made here (not root, no ``ip``/``tc``, no tbf).
        RuntimeError: a rank failed (its stderr's tail), or an implementation gave a wrong sum.
    """
    nproc = hosts if nproc is None else nproc
    impls, rph, rate = _check(hosts, nproc, link, sizes, implementations, rounds, delay_ms)
    load_before = os.getloadavg()[0]
    args = ["--sizes", ",".join(str(int(s)) for s in sizes), "--impls", ",".join(impls), "--rounds", str(rounds),
            "--iface", IFACE] + (["--progress"] if progress else [])
    data = run_job_across_hosts("torchstrategies.bench.allreduce_worker", hosts, nproc, args, rate,
                                delay_ms=delay_ms, total=rounds * len(sizes) * len(impls),
                                desc=f"allreduce across {hosts} hosts", progress=progress, timeout=timeout)
    data.update(load=(load_before, os.getloadavg()[0]), machine=machine())
    return _table(data, hosts, rph, rate, delay_ms)


def _check(hosts: int, nproc: int, link: str | int, sizes: Sequence[int], implementations: Sequence[str] | None,
           rounds: int, delay_ms: float) -> tuple[list[str], int, int]:
    if not 2 <= hosts <= 16:
        raise ValueError(f"hosts must be between 2 and 16, got {hosts}")
    if nproc < hosts or nproc % hosts:
        raise ValueError(f"nproc must be a multiple of hosts={hosts} (ranks per host), got {nproc}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    if not sizes or any(int(s) < 4 for s in sizes):
        raise ValueError(f"sizes must be a non-empty list of byte counts >= 4, got {list(sizes)}")
    rate = parse_rate(link)
    impls = list(dict.fromkeys(implementations or DEFAULT_IMPLEMENTATIONS))
    bad = [i for i in impls if i not in IMPLEMENTATIONS]
    if bad:
        raise ValueError(f"between hosts the rows are {IMPLEMENTATIONS}; {bad} need one host (or no link)")
    if "gloo" not in impls:
        impls.insert(0, "gloo")
    return impls, nproc // hosts, rate


def _table(data: dict[str, Any], hosts: int, rph: int, rate: int, delay_ms: float) -> BenchResult:
    nproc = hosts * rph
    gloo = {r["size"]: r["seconds"] for r in data["rows"] if r["implementation"] == "gloo"}
    link = {(c["size"], c["implementation"]): c for c in data.get("link") or []}
    rtt = data.get("rtt_seconds")
    rows = []
    for r in data["rows"]:
        sec, size, impl = r["seconds"], r["size"], r["implementation"]
        algbw = size / sec / 1e9
        bus = busbw(algbw, nproc)
        counted = link.get((size, impl))
        sent = sum(counted["tx_per_call"].values()) / len(counted["tx_per_call"]) if counted else ""
        theory = link_theory(impl, size, hosts, rph)
        rows.append({
            "size": size_label(size), "implementation": impl, "median_us": sec * 1e6, "algbw_GBps": algbw,
            "busbw_GBps": bus, "speedup_vs_gloo": gloo[size] / sec, "fraction_of_line_rate": bus * 8e9 / rate,
            "link_bytes_per_host": sent, "link_theory": "" if theory is None else theory,
            "link_vs_theory": sent / theory if isinstance(sent, float) and theory else "",
            "latency_vs_rtt": counted["batch_seconds_per_call"] / rtt if rtt and counted and size <= SMALL_SIZE
            else "", "bytes": size,
            "rounds_us": [s * 1e6 for s in r.get("rounds", [])],
            "link_tx_per_call": counted["tx_per_call"] if counted else {},
            "link_rx_per_call": counted["rx_per_call"] if counted else {},
        })
    load = data["load"]
    delay = f", +{delay_ms:g} ms one way" if delay_ms else ""
    title = (f"all-reduce across {hosts} hosts x {rph} ranks, {_rate(rate)} links{delay}, float32 (load "
             f"{load[0]:.2f}, {data['machine']}, torch {data.get('torch')})")
    meta = {"hosts": hosts, "ranks_per_host": rph, "nproc": nproc, "link_bits_per_s": rate, "delay_ms": delay_ms,
            "rtt_seconds": rtt, "load": load, "machine": data["machine"], "rank_hosts": data.get("hosts"),
            "hierarchical_plan": data.get("hierarchical_plan"), "hierarchical_hosts": data.get("hierarchical_hosts"),
            "rounds": data.get("rounds"), "swept_stale_namespaces": data.get("swept_namespaces")}
    return BenchResult(title, COLUMNS, rows, _notes(data, hosts, rph, rate, delay_ms), meta)


def _rate(bits: int) -> str:
    for unit, v in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= v:
            return f"{bits / v:g} {unit}"
    return f"{bits} bit/s"


def _notes(data: dict[str, Any], hosts: int, rph: int, rate: int, delay_ms: float) -> list[str]:
    nproc = hosts * rph
    rtt = data.get("rtt_seconds")
    switch = f"a userspace hub holding every frame {delay_ms:g} ms" if delay_ms else "a Linux bridge"
    notes = [
        f"algbw = size / time; busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce definitions, n = {nproc}); "
        f"fraction_of_line_rate = busbw / {_rate(rate)}; time = the slowest rank's median per round, median of "
        f"{data.get('rounds', 1)} interleaved rounds; every case's sum is checked on every rank before it is timed.",
        f"hosts: {hosts} network namespaces of {rph} rank(s) each (consecutive ranks), each with one veth into "
        f"{switch}, tc tbf at {_rate(rate)} on both ends (each direction); every rank binds its own host's "
        "address (the ring, gloo, the store on host 0).",
        "link_bytes_per_host: bytes each host's veth sent per call (frames: payload, TCP/IP/Ethernet headers, "
        "ACKs, two barriers spread over the calls; mean over hosts); link_theory: payload bytes the plan sends "
        "per host (RING: 2(n-1)/n * size over the one edge leaving each host, (n-1) * size up to "
        "TORCHSTRATEGIES_RING_SMALL_BYTES, where messages are all-gathered whole; HIERARCHICAL: the same with "
        "n = H hosts, once per host; gloo: not modelled).",
    ]
    if rtt:
        notes.append(f"round trip (1-byte TCP ping-pong between host 0 and host 1, median of 50): "
                     f"{rtt * 1e6:.1f} us; latency_vs_rtt (sizes up to 64 KiB) = the time per call of the "
                     "counted batch (calls back to back, the slowest rank's) / round trip. Not median_us: one "
                     "call's time on a rank depends on how far ahead of its peers it starts (a rank that "
                     "starts late finds their data there, one that starts early waits for it), and the "
                     "slowest rank's median is the early one's")
    if data.get("hierarchical_plan") is not None:
        notes.append(f"the HIERARCHICAL row's backend saw {data.get('hierarchical_hosts')} hosts and runs the "
                     f"plan {data.get('hierarchical_plan')}")
    load = data["load"]
    notes.append(f"1-minute load average before/after: {load[0]:.2f} / {load[1]:.2f} on {data.get('cpus')} CPUs; "
                 "the namespaces share this machine's CPUs, so a CPU-bound row is not a link-bound one")
    if data.get("swept_namespaces"):
        notes.append(f"removed stale namespaces of an earlier run: {data['swept_namespaces']}")
    return notes
