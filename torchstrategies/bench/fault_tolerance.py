"""The fault-tolerant mode of MultiWorkerMirrored: ``torchstrategies bench ft-recovery`` and two rows of
``bench train``.

* ``bench train`` rows ``ft-GLOO`` and ``ft-AUTO`` (not default rows: ``--strategy ft-GLOO``): the
  fault-tolerant mode with no failure, to compare with ``mwms-GLOO`` and ``mwms-default`` (the same
  collectives) of the same run: its cost on the fast path.
* ``bench ft-recovery``: in one run, the time a SIGKILL of one worker costs (1) the fault-tolerant mode
  under its launcher and (2) MultiWorkerMirrored under ``torchrun --max-restarts=1`` resuming from its last
  checkpoint (saved every ``checkpoint_every`` steps), both on gloo. Both train the benchmark MLP on the same synthetic
  data; worker 1 kills itself in the middle of step ``kill_at``. Reported: seconds from the kill until the
  step in flight at the kill is applied ("time lost"), the steps redone, and the median step time; for the
  fault-tolerant mode also the pause the returning worker's heal costs the others.

Example:
    >>> from torchstrategies.bench import fault_tolerance
    >>> fault_tolerance.run(nproc=3, steps=80, kill_at=30, progress=False).print()   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from torchstrategies.bench.launch import job_env, run_torchrun
from torchstrategies.bench.mlp import SIZES, mlp
from torchstrategies.bench.report import BenchResult
from torchstrategies.bench.train import BenchContext, _data, register_runner

__all__ = ["run"]

_ROWS = [0]  # bench train rows of this module made so far in this worker: each gets its own job prefix


def _ft_row(implementation: str) -> Callable[[BenchContext], tuple[Callable[[], None], Callable[[], None]]]:
    def setup(ctx: BenchContext) -> tuple[Callable[[], None], Callable[[], None]]:
        import torch
        import torch.distributed as dist

        import torchstrategies as ts

        # The store the mode needs beside the workers: rank 0 hosts it for this row (no worker dies here).
        host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if ctx.rank == 0 else None
        port = torch.tensor([host.port if host is not None else 0])
        dist.broadcast(port, 0)
        _ROWS[0] += 1
        options = ts.FaultTolerance(store=f"127.0.0.1:{int(port.item())}", job=f"bench-train-{_ROWS[0]}",
                                    world_size=ctx.world_size, timeout_seconds=60)
        strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(options, implementation)
        with strategy.scope():
            torch.manual_seed(ctx.seed)
            model = mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = _data(ctx)
        global_batch = ctx.batch * ctx.world_size
        # Every member's part of each global batch is this rank's fixed batch, as in the mwms rows.
        data = ts.GlobalBatches(range(global_batch), global_batch, shuffle=False, collate_fn=lambda _: (x, y))
        loop = strategy.training_loop(model, opt, data)

        def step_fn(batch: tuple[Any, Any]) -> None:  # the mwms rows' step code
            bx, by = batch
            torch.nn.functional.cross_entropy(model(bx), by, reduction="none").sum().div(global_batch).backward()
            opt.step()
            opt.zero_grad()

        def step() -> None:
            loop.step(step_fn)

        def teardown() -> None:
            strategy.shutdown()
            dist.barrier()  # every worker has left the store before rank 0 stops hosting it
            nonlocal host
            host = None

        return step, teardown

    return setup


register_runner("ft-GLOO", _ft_row("GLOO"), default=False)
register_runner("ft-AUTO", _ft_row("AUTO"), default=False)


# --- bench ft-recovery ----------------------------------------------------------------------------------------
def _dataset(spec: dict[str, Any]) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    n = spec["batch"] * spec["nproc"] * 16
    return torch.utils.data.TensorDataset(torch.randn(n, SIZES[0], generator=g),
                                          torch.randint(0, SIZES[-1], (n,), generator=g))


def _log(path: str, step: int) -> None:
    with open(path, "a") as f:
        f.write(f"{step} {time.time()!r}\n")


def _kill_self(out: str) -> None:
    with open(os.path.join(out, "kill"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _ft_worker(spec: dict[str, Any], out: str) -> None:
    import torch

    import torchstrategies as ts

    torch.set_num_threads(1)
    slot = os.environ["TORCHSTRATEGIES_FT_WORKER"]
    victim = slot == "1" and os.environ.get("TORCHSTRATEGIES_FT_RESTART") == "0"
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(ts.FaultTolerance(timeout_seconds=30))
    with strategy.scope():
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    global_batch = spec["batch"] * spec["nproc"]
    loop = strategy.training_loop(model, opt, ts.GlobalBatches(_dataset(spec), global_batch, seed=0))

    def step_fn(batch: list[Any]) -> None:
        if victim and loop.steps == spec["kill_at"]:
            _kill_self(out)
        x, y = batch
        ts.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none"),
                                global_batch_size=global_batch).backward()
        opt.step()
        opt.zero_grad()

    log = os.path.join(out, f"ft.{slot}.{os.getpid()}.log")
    # After ``steps``, go on (up to 20x) until the restarted worker is back, so its heal is measured too.
    while loop.steps < spec["steps"] or (loop.steps < 20 * spec["steps"] and
                                         (loop.generation is None or loop.generation.size < spec["nproc"])):
        loop.step(step_fn)
        _log(log, loop.steps - 1)
    strategy.shutdown()


def _restart_worker(spec: dict[str, Any], out: str) -> None:
    import torch
    from torch.utils.data import DataLoader

    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    victim = rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    # The collectives of the fault-tolerant row (gloo), so the rows differ only in how they recover.
    strategy = ts.MultiWorkerMirroredStrategy(ts.CommunicationOptions(implementation="GLOO"))
    with strategy.scope():
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    global_batch = spec["batch"] * spec["nproc"]
    loader = DataLoader(_dataset(spec), batch_size=global_batch, shuffle=True,
                        generator=torch.Generator().manual_seed(0), drop_last=True)
    data = strategy.experimental_distribute_dataset(loader)
    ckpt = Checkpoint(model=model, optimizer=opt, data=data, step=0)
    path = os.path.join(out, "ckpt.pt")
    if os.path.exists(path):
        ckpt.restore(path)
    step = ckpt.step
    log = os.path.join(out, "restart.log")
    while step < spec["steps"]:
        for x, y in data:
            if victim and step == spec["kill_at"]:
                _kill_self(out)
            loss = ts.compute_average_loss(torch.nn.functional.cross_entropy(model(x), y, reduction="none"),
                                           global_batch_size=global_batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                _log(log, step)
            step += 1
            if step % spec["checkpoint_every"] == 0:
                ckpt.step = step
                ckpt.save(path)
            if step >= spec["steps"]:
                break
    strategy.shutdown()


def _read_log(path: str) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(int(a), float(b)) for a, b in (line.split() for line in f if line.strip())]


def _measure(logs: list[list[tuple[int, float]]], kill_at: int, t_kill: float) -> dict[str, Any]:
    """Time lost (kill -> the step in flight applied), steps redone, median step time, longest pause after."""
    events = sorted(e for log in logs for e in log)
    before = [t for s, t in sorted(set(events)) if t < t_kill]
    gaps = [b - a for a, b in zip(before, before[1:])]
    step_s = statistics.median(gaps) if gaps else float("nan")
    applied_again = min(t for s, t in events if s == kill_at and t > t_kill)
    done_before = {s for s, t in events if t < t_kill}
    redone = len({s for s, t in events if t > t_kill and s in done_before})
    return {"time lost (s)": applied_again - t_kill, "steps redone": redone, "step (ms)": 1e3 * step_s}


def run(nproc: int = 3, steps: int = 120, kill_at: int = 40, checkpoint_every: int = 25, batch: int = 64,
        progress: bool = True) -> BenchResult:
    """Kills worker 1 at step ``kill_at`` under both recoveries; see the module docstring.

    Args:
        nproc: workers (at least 2).
        steps: steps each job trains.
        kill_at: the step in flight when worker 1 is killed.
        checkpoint_every: the restart path's checkpoint interval (steps).
        batch: per-worker batch size.
    """
    if nproc < 2 or not 0 < kill_at < steps:
        raise ValueError(f"need nproc >= 2 and 0 < kill_at < steps, got nproc={nproc}, kill_at={kill_at}, "
                         f"steps={steps}")
    spec = {"nproc": nproc, "steps": steps, "kill_at": kill_at, "checkpoint_every": checkpoint_every,
            "batch": batch}
    env = job_env(TORCHSTRATEGIES_LOG_LEVEL="ERROR")
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as ft_out, tempfile.TemporaryDirectory() as rs_out:
        run_torchrun([sys.executable, "-m", "torchstrategies.strategies.fault_tolerance.launch", "--nproc",
                      str(nproc), "--max-restarts", "1", os.path.abspath(__file__), "--spec", json.dumps(spec),
                      "--worker", "ft", "--out", ft_out],
                     env, total=1, desc="ft-recovery: fault-tolerant", progress=progress, timeout=600)
        logs = [_read_log(os.path.join(ft_out, f)) for f in sorted(os.listdir(ft_out)) if f.endswith(".log")]
        with open(os.path.join(ft_out, "kill")) as f:
            t_kill = float(f.read())
        row = {"recovery": "fault-tolerant (survivors go on, worker healed from a peer)",
               **_measure(logs, kill_at, t_kill)}
        healed = [log for log in logs if log and log[0][0] > 0]  # the returning worker's log starts late
        if healed:
            first = healed[0][0][0]
            t0 = min(t for log in logs for s, t in log if s == first - 1)
            t1 = min(t for log in logs for s, t in log if s == first)
            row["heal pause (s)"] = t1 - t0
        rows.append(row)
        run_torchrun([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                      "--max-restarts=1", "-m", "torchstrategies.bench.fault_tolerance", "--spec", json.dumps(spec),
                      "--worker", "restart", "--out", rs_out],
                     env, total=1, desc="ft-recovery: restart from checkpoint", progress=progress, timeout=600)
        with open(os.path.join(rs_out, "kill")) as f:
            t_kill = float(f.read())
        rows.append({"recovery": f"torchrun --max-restarts, resume from the checkpoint (every "
                                 f"{checkpoint_every} steps)",
                     **_measure([_read_log(os.path.join(rs_out, "restart.log"))], kill_at, t_kill)})
    import torch

    return BenchResult(
        title=f"Time lost per worker failure, MLP {'-'.join(map(str, SIZES))}, batch {batch}/worker, {nproc} workers",
        columns=["recovery", "time lost (s)", "steps redone", "step (ms)", "heal pause (s)"],
        rows=rows,
        notes=[f"worker 1 SIGKILLed in the middle of step {kill_at}; time lost = from the kill until that step is "
               f"applied; torch {torch.__version__}, {os.cpu_count()} CPUs; load average before/after: "
               f"{load0[0]:.1f}/{os.getloadavg()[0]:.1f} (compare rows of one run)"],
        meta=spec,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--worker", choices=["ft", "restart"], required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    (_ft_worker if a.worker == "ft" else _restart_worker)(json.loads(a.spec), a.out)
