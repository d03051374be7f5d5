"""``torchstrategies bench allreduce``: every all-reduce implementation side by side, one torchrun run.

Per (size, implementation): the median time, algbw = size / time, busbw = algbw * 2(n-1)/n (nccl-tests'
all-reduce definitions), the speed-up over gloo and the fraction of the loopback roofline (raw TCP bytes
between the ranks, ``bench/loopback.py``) measured by the same worker in the same run. The worker checks
every case's sum before timing it; ``simulate_hosts`` splits the ranks into simulated hosts for
HIERARCHICAL. docs/collectives.md ("``torchstrategies bench allreduce``: what it measures") has the details.

Example:
    >>> from torchstrategies.bench import allreduce
    >>> r = allreduce.run(nproc=2, sizes=[4096, 1 << 20])      # doctest: +SKIP
    >>> r.print(); allreduce.plot(r, "allreduce.png")
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

from torchstrategies.bench.launch import job_env, run_job
from torchstrategies.bench.loopback import socket_buffer_bytes
from torchstrategies.bench.report import BenchResult

__all__ = ["run", "plot", "busbw", "machine", "size_label", "DEFAULT_SIZES", "DEFAULT_IMPLEMENTATIONS",
           "IMPLEMENTATIONS", "SIMULATED_HOSTS_IMPLEMENTATIONS", "ROOFLINE", "COLUMNS"]

ROOFLINE = "loopback-roofline"
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
DEFAULT_IMPLEMENTATIONS = ["gloo", "shm", "shm-comm", "shm-zero-copy", "dist-backend", "ring", ROOFLINE]
# With simulated hosts SHM cannot span the world group; HIERARCHICAL is what is worth seeing there.
SIMULATED_HOSTS_IMPLEMENTATIONS = ["gloo", "ring", "hierarchical", "dist-backend", ROOFLINE]
IMPLEMENTATIONS = DEFAULT_IMPLEMENTATIONS + ["hierarchical", "auto"]
_SHM = ("shm", "shm-comm", "shm-zero-copy")
# Rows that measure a reference, not something a user can choose (compare never recommends them): the
# shared-memory communicator called directly, and the loopback roofline.
REFERENCES = ("shm-comm", ROOFLINE)
COLUMNS = ["size", "implementation", "median_us", "algbw_GBps", "busbw_GBps", "speedup_vs_gloo",
           "fraction_of_roofline"]


def busbw(algbw: float, nranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: ``algbw * 2(n-1)/n`` (what each rank sends per second
    in a ring; comparable with the link's bandwidth whatever the rank count).

    >>> busbw(1.0, 2), busbw(1.0, 4), busbw(1.0, 1)
    (1.0, 1.5, 0.0)
    """
    return algbw * 2 * (nranks - 1) / nranks


def size_label(n: int) -> str:
    """A byte count as the table shows it: ``64 MiB``, ``4 KiB``, ``1000 B``."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def machine() -> str:
    """One line naming this machine: CPU model, logical CPUs, OS and Python."""
    from torchstrategies.env_info import cpu_model

    return (f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def run(nproc: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
        implementations: Sequence[str] | None = None, progress: bool = True,
        timeout: float = 1200.0, rounds: int = 3, simulate_hosts: int = 1, hosts: int = 0,
        link: str | int = "1gbit", delay_ms: float = 0.0) -> BenchResult:
    """Launches ``torchrun --standalone --nproc_per_node nproc`` on the worker and tabulates its timings;
    with ``hosts``, runs the ranks in that many network namespaces on rate-limited links instead
    (``bench/allreduce_hosts.py``, needs root).

    Args:
        nproc: ranks on this host.
        sizes: message sizes in bytes (float32 tensors; the roofline moves raw bytes).
        implementations: any of gloo, shm, shm-comm, shm-zero-copy, dist-backend, ring, hierarchical, auto,
            loopback-roofline. gloo is always added (the speed-ups are over it). Default:
            DEFAULT_IMPLEMENTATIONS, or SIMULATED_HOSTS_IMPLEMENTATIONS with ``simulate_hosts > 1``.
        progress: show a progress bar on stderr.
        timeout: seconds before the launch is killed.
        rounds: every case is timed once per round, the cases interleaved; the median over rounds is
            reported (a burst of load from other jobs then hits one round of every row, not one row).
        simulate_hosts: split the ranks into this many simulated hosts (``TORCHSTRATEGIES_HOST_ID`` per
            rank, ``nproc / simulate_hosts`` consecutive ranks each), so HIERARCHICAL runs its inter-host
            stage; must divide ``nproc``. SHM rows cannot span hosts and are refused then.
        hosts: 2 or more: real hosts instead, one network namespace each with ``nproc / hosts`` ranks and a
            veth of rate ``link`` (tc's spelling: "1gbit", "10gbit"), ``delay_ms`` one-way delay in the switch;
            rows gloo, ring, hierarchical, auto, dist-backend (:func:`allreduce_hosts.run`).
        link: see ``hosts``.
        delay_ms: see ``hosts``.

    Returns:
        BenchResult with one row per (size, implementation); the machine, the load and the host of every
        rank in ``title``/``notes``/``meta``.

    Raises:
        ValueError: a bad argument (names the value).
        RuntimeError: the launch failed, or an implementation gave a wrong sum (the worker checks every
            case before timing it; the message names the implementation, the size and the ranks).
    """
    if hosts:
        if simulate_hosts != 1:
            raise ValueError(f"simulate_hosts={simulate_hosts} and hosts={hosts}: choose one (hosts are real)")
        from torchstrategies.bench import allreduce_hosts

        return allreduce_hosts.run(hosts, nproc, link, sizes, implementations, rounds, delay_ms, progress, timeout)
    impls = _implementations(nproc, sizes, implementations, rounds, simulate_hosts)
    env = job_env()
    env.pop("TORCHSTRATEGIES_HOST_ID", None)  # the worker sets it per rank, or the hostname applies
    load_before = os.getloadavg()[0]
    args = ["--sizes", ",".join(str(int(s)) for s in sizes), "--impls", ",".join(impls), "--rounds", str(rounds),
            "--simulate-hosts", str(simulate_hosts)] + (["--progress"] if progress else [])
    total = rounds * (len(sizes) * len(impls) + int(any(i in _SHM for i in impls)))
    data = run_job("torchstrategies.bench.allreduce_worker", nproc, args, env, total=total, desc="allreduce bench",
                   progress=progress, timeout=timeout)
    data["load"] = (load_before, os.getloadavg()[0])
    data["machine"] = machine()
    data["simulate_hosts"] = simulate_hosts
    return _table(data, nproc)


def _implementations(nproc: int, sizes: Sequence[int], implementations: Sequence[str] | None, rounds: int,
                     simulate_hosts: int) -> list[str]:
    """Checks :func:`run`'s arguments; returns the rows to time, gloo first (the roofline only with 2+ ranks).

    Raises:
        ValueError: a bad argument (names the value).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if simulate_hosts < 1 or nproc % simulate_hosts:
        raise ValueError(f"simulate_hosts must be >= 1 and divide nproc={nproc}, got {simulate_hosts}")
    if not sizes or any(int(s) < 4 for s in sizes):
        raise ValueError(f"sizes must be a non-empty list of byte counts >= 4, got {list(sizes)}")
    socket_buffer_bytes()  # a bad TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES fails here, not in every rank
    if implementations is None:
        implementations = SIMULATED_HOSTS_IMPLEMENTATIONS if simulate_hosts > 1 else DEFAULT_IMPLEMENTATIONS
    bad = [i for i in implementations if i not in IMPLEMENTATIONS]
    if bad:
        raise ValueError(f"unknown implementations {bad}; choose from {IMPLEMENTATIONS}")
    if simulate_hosts > 1 and any(i in _SHM for i in implementations):
        raise ValueError(f"implementations {[i for i in implementations if i in _SHM]} need every rank on one "
                         f"host; with simulate_hosts={simulate_hosts} use e.g. {SIMULATED_HOSTS_IMPLEMENTATIONS}")
    impls = list(dict.fromkeys(implementations))
    if "gloo" not in impls:
        impls.insert(0, "gloo")
    if nproc < 2 and ROOFLINE in impls:
        impls.remove(ROOFLINE)  # nothing to send to
    return impls


def _table(data: dict[str, Any], nproc: int) -> BenchResult:
    gloo = {r["size"]: r["seconds"] for r in data["rows"] if r["implementation"] == "gloo"}
    roof = {r["size"]: r["seconds"] for r in data["rows"] if r["implementation"] == ROOFLINE}
    rows = []
    for r in data["rows"]:
        sec = r["seconds"]
        algbw = r["size"] / sec / 1e9
        rows.append({
            "size": size_label(r["size"]),
            "implementation": r["implementation"],
            "median_us": sec * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": busbw(algbw, nproc),
            "speedup_vs_gloo": gloo[r["size"]] / sec,
            # busbw(impl) / busbw(roofline) at the same size and rank count = roofline time / impl time
            "fraction_of_roofline": roof[r["size"]] / sec if r["size"] in roof else "",
            "bytes": r["size"],
            "rounds_us": [s * 1e6 for s in r.get("rounds", [])],
        })
    load = data.get("load")
    sim = data.get("simulate_hosts", 1)
    layout = f", {sim} simulated hosts x {nproc // sim}" if sim > 1 else ""
    head = f"load {load[0]:.2f}, " if load else ""
    title = (f"all-reduce, {nproc} ranks{layout}, float32 ({head}{data.get('machine', '')}, "
             f"torch {data.get('torch')})")
    meta = {"packed_seconds": data.get("packed"), "nproc": nproc, "load": load, "machine": data.get("machine"),
            "hosts": data.get("hosts") or [], "hierarchical_hosts": data.get("hierarchical_hosts"),
            "hierarchical_plan": data.get("hierarchical_plan"), "simulate_hosts": sim,
            "rounds": data.get("rounds"), "baselines": list(REFERENCES)}
    return BenchResult(title, COLUMNS, rows, _notes(data, nproc, bool(roof)), meta)


def _notes(data: dict[str, Any], nproc: int, roofline: bool) -> list[str]:
    """What the table's numbers mean, the roofline's and the packed case's set-up, the hosts and the load."""
    notes = [
        f"algbw = size / time; busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce definitions, n = {nproc}); "
        f"time = the slowest rank's median per round, median of {data.get('rounds', 1)} interleaved rounds; "
        "every case's sum is checked on every rank before it is timed.",
    ]
    if roofline:
        buf = data.get("socket_buffer_bytes")
        bufs = f"SO_SNDBUF/SO_RCVBUF {buf} bytes" if buf else "socket buffers autotuned by the kernel"
        notes.append(
            f"{ROOFLINE}: every rank sends 2(n-1)/n * size bytes (what one ring all-reduce sends per rank) to "
            "rank+1 and receives as many from rank-1 at once, over TCP on 127.0.0.1 (one Python thread per "
            f"rank, non-blocking, {bufs}, no reduction); fraction_of_roofline = busbw / its busbw (SHM rows use "
            "no sockets and can exceed 1).")
    if any(r["implementation"] in _SHM for r in data["rows"]):
        notes.append("shm-zero-copy reduces a collectives.buffer() tensor in place; shm-comm calls the "
                     "shared-memory communicator directly (no backend, no API layer); dist-backend is "
                     "dist.all_reduce on a 'torchstrategies' process group (what DDP calls).")
    p = data.get("packed")
    if p:
        notes.append(
            f"packed: 100 x 10k-float all-reduce: 100 separate gloo calls {p['gloo-100-calls'] * 1e3:.2f} ms; "
            f"packed SHM {p['shm'] * 1e3:.2f} ms ({p['gloo-100-calls'] / p['shm']:.1f}x); "
            f"packed GLOO {p['gloo'] * 1e3:.2f} ms ({p['gloo-100-calls'] / p['gloo']:.1f}x)")
    hosts = data.get("hosts") or []
    if len(set(hosts)) > 1:
        notes.append(f"simulated hosts (TORCHSTRATEGIES_HOST_ID per rank): {hosts}; the HIERARCHICAL row's "
                     f"backend saw {data.get('hierarchical_hosts')} hosts and runs the plan "
                     f"{data.get('hierarchical_plan')}")
    load = data.get("load")
    if load:
        notes.append(f"1-minute load average of this machine before/after the run: {load[0]:.2f} / {load[1]:.2f} "
                     f"on {data.get('cpus')} CPUs (ratios are from one run, so both sides saw the same load)")
    return notes


def plot(result: BenchResult, path: str) -> None:
    """Median time and bus bandwidth against message size, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    impls = list(dict.fromkeys(r["implementation"] for r in result.rows))
    for impl in impls:
        rs = [r for r in result.rows if r["implementation"] == impl]
        xs = [r["bytes"] for r in rs]
        ax1.plot(xs, [r["median_us"] for r in rs], marker="o", label=impl)
        ax2.plot(xs, [r["busbw_GBps"] for r in rs], marker="o", label=impl)
    for ax, label in ((ax1, "median time (us)"), (ax2, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend()
    fig.suptitle(result.title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
