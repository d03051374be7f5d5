"""``torchstrategies bench agreement``: what MultiWorkerMirrored's per-step agreement check costs a step, paired.

One torchrun job of ``nproc`` ranks trains the benchmark MLP (784-1024-1024-10, batch ``batch`` per rank,
SGD: the ``mwms-default`` row of ``bench train``) under one MultiWorkerMirroredStrategy and alternates blocks
of ``steps`` steps with the check at its default period (``AGREEMENT_SLICES``) and off (period 0, what
``TORCHSTRATEGIES_AGREEMENT=0`` gives), in the order on/off, off/on, ... so that drift of the machine's speed
falls on both alike. Each block's time is the slowest rank's. Reported:

* ms a step with the check and without it (medians over the blocks);
* the paired difference: the median over block pairs of (with - without), in µs and in % of the step
  without it: the check's cost a step, as ``bench train``'s ``mwms-default`` / ``mwms-no-agreement`` rows
  measure it, but from pairs run seconds apart instead of medians of separate runs;
* the check's own wall time a step inside the optimizer's step hooks (its C++ calls, its all-reduce with the
  wait for the other ranks, its Python), per rank: what the check does, not counting what it makes the rest
  of the step pay (caches) or saves it (a rank that waited here waits less in the next all-reduce).

Compare ``bench train --strategy mwms-default --strategy mwms-no-agreement``: the same two rows as separate
runs of a fresh strategy each.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

from torchstrategies.bench.launch import job_env, run_job, worker_spec
from torchstrategies.bench.mlp import SIZES, mlp
from torchstrategies.bench.report import BenchResult

__all__ = ["run", "plot"]


def _worker(spec: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist

    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    strategy = MultiWorkerMirroredStrategy()
    rank, world = strategy.extended.rank, strategy.extended.world_size
    with strategy.scope():
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(spec["batch"], SIZES[0], generator=g)
    y = torch.randint(0, SIZES[-1], (spec["batch"],), generator=g)
    global_batch = spec["batch"] * world

    def step() -> None:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        (per_example.sum() / global_batch).backward()
        opt.step()
        opt.zero_grad()

    check = strategy.extended.agreement
    period = check.step.slices
    inside = [0.0]

    def timed(hook: Any) -> Any:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return hook(*args)
            finally:
                inside[0] += time.perf_counter() - t0
        return call

    check.before_step = timed(check.before_step)  # type: ignore[method-assign]
    check.after_step = timed(check.after_step)  # type: ignore[method-assign]
    for _ in range(spec["warmup"]):
        step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    own: list[float] = []
    for b in range(spec["blocks"]):
        for kind in (("on", "off") if b % 2 == 0 else ("off", "on")):
            check.step.slices = period if kind == "on" else 0
            for _ in range(3):  # the other setting's last step is behind us
                step()
            dist.barrier()
            inside[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(spec["steps"]):
                step()
            dt = time.perf_counter() - t0
            if kind == "on":
                own.append(inside[0] / spec["steps"])
            slowest = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[kind].append(float(slowest) / spec["steps"])
        if rank == 0:
            print(f"PROGRESS {b + 1} {spec['blocks']} block", flush=True)
    mine = torch.tensor([statistics.median(own)], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "own": [float(t) for t in every], "period": period}, f)
    strategy.shutdown()


def run(nproc: int = 2, blocks: int = 40, steps: int = 25, warmup: int = 30, batch: int = 64,
        progress: bool = True) -> BenchResult:
    """Launches the job (see the module docstring) and returns its table.

    Args:
        nproc: ranks (processes) on this host (at least 2).
        blocks: block pairs (one with the check, one without).
        steps: timed steps per block.
        warmup: untimed steps before the first block.
        batch: per-rank batch size.
    """
    if nproc < 2 or blocks < 1 or steps < 1:
        raise ValueError(f"need nproc >= 2, blocks >= 1 and steps >= 1, got nproc={nproc}, blocks={blocks}, "
                         f"steps={steps}")
    spec = {"blocks": blocks, "steps": steps, "warmup": warmup, "batch": batch}
    env = job_env()
    load0 = os.getloadavg()
    data = run_job("torchstrategies.bench.agreement_cost", nproc, ["--spec", json.dumps(spec)], env,
                   total=blocks, desc="bench agreement", progress=progress)
    on, off = data["times"]["on"], data["times"]["off"]
    without = statistics.median(off)
    pairs = [a - b for a, b in zip(on, off)]
    diff = statistics.median(pairs)
    rows = [{"measure": "ms a step, check on", "value": 1e3 * statistics.median(on)},
            {"measure": "ms a step, check off", "value": 1e3 * without},
            {"measure": "paired difference (us a step)", "value": 1e6 * diff},
            {"measure": "paired difference (% of the step)", "value": 100.0 * diff / without}]
    rows += [{"measure": f"rank {r}: the check's own time in the step hooks (us a step)", "value": 1e6 * t}
             for r, t in enumerate(data["own"])]
    import torch

    return BenchResult(
        title=f"The agreement check's cost, MultiWorkerMirrored({nproc}), MLP {'-'.join(map(str, SIZES))}, "
              f"batch {batch}/rank",
        columns=["measure", "value"],
        rows=rows,
        notes=[f"{blocks} pairs of {steps}-step blocks, the check at its default period ({data['period']} "
               f"slices) and off, alternated in one job; medians; torch {torch.__version__}, {os.cpu_count()} "
               f"CPUs, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; load average before/after: "
               f"{load0[0]:.1f}/{os.getloadavg()[0]:.1f}"],
        meta={**spec, "nproc": nproc, "times": data["times"], "own": data["own"]},
    )


def plot(result: BenchResult, path: str) -> None:
    """ms a step of each block, with the check and without it, in the order they ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = result.meta["times"]
    fig, ax = plt.subplots(figsize=(7, 3))
    for kind, color in (("on", "#3a7"), ("off", "#888")):
        ax.plot([1e3 * t for t in times[kind]], marker=".", color=color, label=f"check {kind}")
    ax.set_xlabel("block pair")
    ax.set_ylabel("ms a step")
    ax.set_title(result.title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # the torchrun worker that run() launches
    _worker(*worker_spec())
