"""Runs a benchmark's worker module across simulated hosts: one network namespace per host on rate-limited
links (``bench/netns.py``), ``nproc / hosts`` ranks in each, consecutive ranks per host.

:func:`run_job_across_hosts` is :func:`~torchstrategies.bench.launch.run_job` between hosts: each rank is
started directly in its host's namespace with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR =
host 0's address, MASTER_PORT) and its own address for everything it binds: ``TORCHSTRATEGIES_HOST_ID`` names
its host (the backend's plan), ``TORCHSTRATEGIES_RING_ADDR`` is its namespace's address (the ring),
``GLOO_SOCKET_IFNAME`` the link (gloo). Rank 0's ``PROGRESS`` lines drive a progress bar; one rank that fails,
or the timeout, stops them all; the namespaces are deleted on the way out, also on SIGTERM/SIGHUP/Ctrl-C.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from torchstrategies.bench.launch import job_env
from torchstrategies.bench.netns import IFACE, Network, handle_signals

__all__ = ["run_job_across_hosts", "MASTER_PORT"]

MASTER_PORT = 29500  # free: every namespace is new


def run_job_across_hosts(module: str, hosts: int, nproc: int, args: list[str], rate_bits: int, *,
                         delay_ms: float = 0.0, total: int, desc: str, progress: bool,
                         timeout: float) -> dict[str, Any]:
    """Makes the hosts, runs ``python -m module *args --json OUT`` on every rank, deletes the hosts; returns
    the JSON object rank 0 wrote, with ``swept_namespaces`` (stale namespaces removed first).

    Raises:
        ValueError: ``nproc`` is not a multiple of ``hosts``.
        netns.NetworkUnavailable: namespaces cannot be made here (the message says why).
        RuntimeError: a rank failed or the time ran out (the first failed rank's stderr tail).
    """
    if hosts < 1 or nproc < hosts or nproc % hosts:
        raise ValueError(f"nproc must be a multiple of hosts={hosts} (ranks per host), got {nproc}")
    with tempfile.TemporaryDirectory() as tmp, handle_signals(), Network(hosts, rate_bits, delay_ms) as net:
        out = os.path.join(tmp, "result.json")
        _run_ranks(net, module, nproc, nproc // hosts, [*args, "--json", out], total=total, desc=desc,
                   progress=progress, timeout=timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"{desc}: rank 0 wrote no results")
        with open(out) as f:
            data: dict[str, Any] = json.load(f)
        data["swept_namespaces"] = net.swept
    return data


def _rank_env(net: Network, rank: int, nproc: int, rph: int) -> dict[str, str]:
    host = rank // rph
    env = job_env(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank % rph), LOCAL_WORLD_SIZE=str(rph),
                  GROUP_RANK=str(host), MASTER_ADDR=net.address(0), MASTER_PORT=str(MASTER_PORT),
                  TORCHSTRATEGIES_HOST_ID=f"host{host}", TORCHSTRATEGIES_RING_ADDR=net.address(host),
                  GLOO_SOCKET_IFNAME=IFACE)
    return env


def _run_ranks(net: Network, module: str, nproc: int, rph: int, args: list[str], *, total: int, desc: str,
               progress: bool, timeout: float) -> None:
    """Starts every rank in its host's namespace; follows rank 0's PROGRESS lines; kills every rank when one
    fails or the time is up.

    Raises:
        RuntimeError: a rank exited non-zero or the run timed out (with the first failed rank's stderr tail).
    """
    cmd = [sys.executable, "-m", module, *args]
    errs: list[IO[str]] = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
    procs = [net.popen(r // rph, cmd, _rank_env(net, r, nproc, rph), stderr=errs[r],
                       stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL) for r in range(nproc)]
    failed: list[str] = []
    done = threading.Event()

    def watch() -> None:  # a rank that dies leaves the others waiting on it: stop them all
        deadline = time.monotonic() + timeout
        while not done.wait(0.5):
            codes = [p.poll() for p in procs]
            late = time.monotonic() > deadline
            if late or any(c not in (None, 0) for c in codes):
                failed.append(f"did not finish within {timeout:g} s" if late else f"exit codes {codes}")
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, file=sys.stderr)
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if line.startswith("PROGRESS") and bar is not None:
                bar.update(1)
                bar.set_postfix_str(line.split()[-1])
        codes = [p.wait() for p in procs]
    finally:
        done.set()
        watcher.join()
        if bar is not None:
            bar.close()
    if failed or any(codes):
        first = next((r for r, c in enumerate(codes) if c not in (0, -9)), 0)
        errs[first].seek(0)
        tail = errs[first].read()[-4000:]
        raise RuntimeError(f"{desc}: {failed[0] if failed else f'exit codes {codes}'}; "
                           f"rank {first}'s stderr:\n{tail}")
    for e in errs:
        e.close()
