"""One shared way to run a function on N ranks, with gloo on 127.0.0.1 and a hard timeout.

    from harness import run_ranks

    def _body(rank, world_size, x):        # top-level, so spawn can pickle it
        return rank * x

    def test_something():
        assert run_ranks(_body, 2, args=(3,)) == [0, 3]

Each rank is a fresh ``spawn`` process with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set (as torchrun would) and, unless ``init_process_group=False``, a gloo
process group already initialized. The rendezvous store is hosted here, in the test's process, as
torchrun's agent hosts it (:class:`Rendezvous`): the store binds port 0 itself and its port is handed on
as MASTER_PORT, so no other process on a busy machine can take the port between its choice and its bind
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank, rank 0 included, connects to it as a client).

The function's return values come back in rank order. If any rank raises, the test fails with that
rank's traceback; if the ranks do not all finish within ``timeout`` seconds, every rank is killed and
the test fails naming the ranks that were still running. No rank is ever left behind.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run_ranks", "free_port", "Rendezvous", "RankFailure"]


class RankFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


def free_port() -> int:
    """A port nobody listens on right now: only for an address that must NOT answer (a store to host, use
    :class:`Rendezvous` or ``TCPStore(port=0)`` and its ``.port``: a port chosen here and bound later can
    be taken by another process in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rendezvous:
    """A job's rendezvous store, hosted in this process as torchrun's agent hosts it.

    ``TCPStore(port=0)``: the store binds a port the kernel picks, and :attr:`port` hands it on. ``env()``
    is what each rank needs to connect to it (MASTER_ADDR / MASTER_PORT, and torchrun's
    ``TORCHELASTIC_USE_AGENT_STORE``, which ``init_process_group("env://")``, MultiWorkerMirroredStrategy
    and the parameter server's rendezvous honour by connecting as clients). A test that launches its own
    processes, or needs the port in another variable (TF_CONFIG, SLURM's), makes one and passes it to
    :func:`run_ranks`::

        with Rendezvous() as rdzv:
            run_ranks(fn, 4, rendezvous=rdzv, env_per_rank=lambda r: {"TF_CONFIG": config(rdzv.port, r)})
    """

    def __init__(self, timeout: float = 300.0) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False)
        self.port: int = self.store.port

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0"}

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]  # the last reference: the server stops

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entry(fn, rank, world_size, args, env, init_pg, pg_timeout, q):
    os.environ.update(env)
    try:
        if init_pg:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        result = fn(rank, world_size, *args)
        q.put((rank, "ok", result))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if init_pg:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 90.0,
    init_process_group: bool = True,
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    env_per_rank: Callable[[int], dict[str, str]] | None = None,
    expect_failure: Sequence[int] = (),
    rendezvous: Rendezvous | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; returns results by rank.

    Args:
        fn: a picklable (top-level) function.
        world_size: number of ranks.
        args: extra positional arguments (picklable).
        timeout: hard wall-clock limit for the whole run, in seconds.
        init_process_group: initialize a gloo process group in each rank first.
        pg_timeout: the process group's own timeout, in seconds.
        env: environment variables for every rank.
        env_per_rank: a function giving extra environment variables per rank.
        expect_failure: ranks allowed to die or raise (fault-injection tests); their result is the
            error text, or None if they died without reporting.
        rendezvous: the store the ranks meet at (None: a new :class:`Rendezvous`, closed at the end).

    Raises:
        RankFailure: a rank raised or died unexpectedly, or the run passed ``timeout``.
    """
    own = rendezvous is None
    rdzv = Rendezvous(timeout=max(timeout, pg_timeout) + 60) if rendezvous is None else rendezvous
    try:
        return _run(fn, world_size, args, timeout, init_process_group, pg_timeout, env, env_per_rank,
                    expect_failure, rdzv)
    finally:
        if own:
            rdzv.close()


def _run(fn, world_size, args, timeout, init_process_group, pg_timeout, env, env_per_rank, expect_failure,
         rdzv: Rendezvous) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for rank in range(world_size):
        e = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            **rdzv.env(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        e.update(env or {})
        if env_per_rank is not None:
            e.update(env_per_rank(rank))
        p = ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, tuple(args), e, init_process_group, pg_timeout, q),
            daemon=True,
        )
        p.start()
        procs.append(p)

    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailure(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                    f"(finished: {sorted(results)})"
                )
            try:
                rank, status, payload = q.get(timeout=min(0.5, remaining))
                results[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank not in results and not p.is_alive():
                    # Give its queued message a moment to arrive before calling it dead.
                    try:
                        while True:
                            r2, s2, p2 = q.get(timeout=1.0)
                            results[r2] = (s2, p2)
                    except queue.Empty:
                        pass
                    if rank not in results:
                        if rank in expect_failure:
                            results[rank] = ("died", None)
                        else:
                            raise RankFailure(f"rank {rank} died with exit code {p.exitcode} without a result")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        q.close()

    out: list[Any] = []
    for rank in range(world_size):
        status, payload = results[rank]
        if status == "error" and rank not in expect_failure:
            raise RankFailure(f"rank {rank} raised:\n{payload}")
        out.append(payload)
    return out
