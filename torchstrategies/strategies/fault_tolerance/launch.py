"""A launcher for fault-tolerant jobs: hosts the job's TCPStore and restarts each worker on its own.

``python -m torchstrategies.strategies.fault_tolerance.launch --nproc 3 --max-restarts 3 train.py ARGS``

It plays the part torchrun's agent plays (it hosts the store, which outlives every worker), but a worker
that exits with an error (or is killed) is restarted alone, up to ``--max-restarts`` times per worker
slot, while the others go on; the job ends when every worker has exited with status 0, or with the first
status of a slot that ran out of restarts (the others go on without it, down to ``min_workers``). Each worker gets
``TORCHSTRATEGIES_FT_STORE``, ``TORCHSTRATEGIES_FT_WORKER`` (its slot), ``WORLD_SIZE``, ``LOCAL_RANK``,
and ``TORCHSTRATEGIES_FT_RESTART`` (how many times its slot was restarted).

On many hosts run one launcher per host with ``--store HOST:PORT`` pointing at the first host's launcher
(started with ``--port PORT``) and ``--slot-offset`` to number the slots.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from torchstrategies.strategies.fault_tolerance.options import STORE_ENV, WORKER_ENV

__all__ = ["Worker", "launch", "main"]


@dataclasses.dataclass
class Worker:
    """One worker slot: its current process and how often it was restarted."""

    slot: int
    process: subprocess.Popen[bytes]
    restarts: int = 0
    pids: list[int] = dataclasses.field(default_factory=list)
    returncode: int | None = None


def host_store(port: int = 0) -> dist.TCPStore:
    """The job's store, served from this process until it exits."""
    return dist.TCPStore("127.0.0.1" if port == 0 else "0.0.0.0", port, is_master=True, wait_for_workers=False)


def launch(cmd: Sequence[str], nproc: int, max_restarts: int, *, store: str | None = None, slot_offset: int = 0,
           world_size: int | None = None, env: dict[str, str] | None = None, timeout: float | None = None,
           on_tick: Callable[[list[Worker]], None] | None = None, port: int = 0) -> list[Worker]:
    """Runs ``nproc`` workers of ``cmd`` until all exit 0, restarting a failed one alone.

    Args:
        store: ``host:port`` of a store hosted elsewhere; None hosts one here.
        timeout: seconds after which every worker is killed (``TimeoutError``).
        on_tick: called every 10 ms with the workers (tests inject faults from it).

    Returns:
        The workers, each with its ``pids`` (one per incarnation) and final ``returncode`` (that of its last
        incarnation).
    """
    hosted = host_store(port) if store is None else None
    address = store if store is not None else f"127.0.0.1:{hosted.port}"  # type: ignore[union-attr]
    base = dict(os.environ if env is None else env)
    base[STORE_ENV] = address
    base["WORLD_SIZE"] = str(world_size if world_size is not None else nproc)

    def start(slot: int, restarts: int) -> subprocess.Popen[bytes]:
        e = dict(base, LOCAL_RANK=str(slot - slot_offset), TORCHSTRATEGIES_FT_RESTART=str(restarts))
        e[WORKER_ENV] = str(slot)
        return subprocess.Popen(list(cmd), env=e)

    workers = []
    for i in range(nproc):
        p = start(slot_offset + i, 0)
        workers.append(Worker(slot_offset + i, p, pids=[p.pid]))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            running = 0
            for w in workers:
                if w.returncode is not None:
                    continue
                rc = w.process.poll()
                if rc is None:
                    running += 1
                elif rc == 0:
                    w.returncode = 0
                elif w.restarts < max_restarts:
                    w.restarts += 1
                    w.process = start(w.slot, w.restarts)
                    w.pids.append(w.process.pid)
                    running += 1
                else:
                    w.returncode = rc  # out of restarts: the others go on without it
            if running == 0:
                return workers
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"fault-tolerant launch: workers still running after {timeout} s")
            if on_tick is not None:
                on_tick(workers)
            time.sleep(0.01)
    finally:
        for w in workers:
            if w.process.poll() is None:
                w.process.send_signal(signal.SIGCONT)
                w.process.terminate()
        for w in workers:
            try:
                w.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
        del hosted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstrategies.strategies.fault_tolerance.launch",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True, help="workers on this host")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts per worker slot")
    parser.add_argument("--store", default=None, help="host:port of the store (default: host one here)")
    parser.add_argument("--port", type=int, default=0, help="port of the store hosted here (0: any)")
    parser.add_argument("--slot-offset", type=int, default=0, help="number of this host's first slot")
    parser.add_argument("--world-size", type=int, default=None, help="workers on all hosts (default: --nproc)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    workers = launch([sys.executable, a.script, *a.args], a.nproc, a.max_restarts, store=a.store, port=a.port,
                     slot_offset=a.slot_offset, world_size=a.world_size)
    return next((w.returncode for w in workers if w.returncode), 0) or 0


if __name__ == "__main__":
    sys.exit(main())
