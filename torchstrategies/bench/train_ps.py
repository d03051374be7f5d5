"""Training throughput of ParameterServerStrategy: ``torchstrategies bench train-ps --nproc 4``.

One torchrun job (launched here): rank 0 is the chief, ranks 1..num_ps are parameter servers, the rest are
workers. The chief trains the benchmark MLP (784-1024-1024-10, synthetic data, SGD, ``batch`` samples per
step on one worker) by scheduling ``steps`` training steps with a ClusterCoordinator after ``warmup`` steps,
and reports steps/s, samples/s and the bytes a step pulls from and pushes to the ps. For scale, the chief
also times the same steps as plain single-process training (``single-process`` row), in the same job.

The rows have the columns of ``bench/train.py`` plus ``steps/s``, ``pulled B/step``, ``pushed B/step``;
``rows_for_train_table(result)`` gives them in that table's shape so ``torchstrategies bench train`` can
append them.

Example:
    >>> from torchstrategies.bench import train_ps
    >>> result = train_ps.run(nproc=4, steps=50, progress=False)     # doctest: +SKIP
    >>> result.print()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from torchstrategies.bench.launch import job_env, run_job, worker_spec
from torchstrategies.bench.mlp import SIZES, mlp
from torchstrategies.bench.report import BenchResult, bar_chart, median

if TYPE_CHECKING:
    import torch

    from torchstrategies.cluster_resolver import TorchrunClusterResolver

__all__ = ["run", "plot", "rows_for_train_table"]


def _batches(batch: int, n: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (batch,), generator=g))
            for _ in range(n)]


def _chief(resolver: TorchrunClusterResolver, args: dict[str, Any]) -> dict[str, Any]:
    import torch

    import torchstrategies as ts

    steps, warmup, rounds, batch = args["steps"], args["warmup"], args["rounds"], args["batch"]
    data = _batches(batch)

    # Single-process baseline, same model, same steps.
    torch.manual_seed(0)
    local = mlp()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01)
    single: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(steps):
            x, y = data[i % len(data)]
            local_opt.zero_grad()
            torch.nn.functional.cross_entropy(local(x), y).backward()
            local_opt.step()
        single.append(time.perf_counter() - t0)

    strategy = ts.ParameterServerStrategy(resolver)
    with strategy.scope():
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    coordinator = ts.coordinator.ClusterCoordinator(strategy)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    ps_times: list[float] = []
    traffic: list[tuple[int, int]] = []
    for r in range(rounds):
        for i in range(warmup):
            coordinator.schedule(step, args=data[i % len(data)])
        coordinator.join()
        before = coordinator.traffic()
        t0 = time.perf_counter()
        for i in range(steps):
            coordinator.schedule(step, args=data[i % len(data)])
        coordinator.join()
        ps_times.append(time.perf_counter() - t0)
        after = coordinator.traffic()
        traffic.append((after["pulled_bytes"] - before["pulled_bytes"], after["pushed_bytes"] - before["pushed_bytes"]))
        print(f"PROGRESS {r + 1} {rounds}", flush=True)
    strategy.shutdown()
    return {"single": single, "ps": ps_times, "traffic": traffic}


def _worker(args: dict[str, Any], out: str) -> None:
    import torch

    import torchstrategies as ts
    from torchstrategies.parameter_server import Server

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=args["num_ps"])
    if resolver.task_type != "chief":
        Server(resolver).join()
        return
    with open(out, "w") as f:
        json.dump(_chief(resolver, args), f)


def run(nproc: int = 4, num_ps: int = 1, steps: int = 100, warmup: int = 10, rounds: int = 3, batch: int = 64,
        progress: bool = True) -> BenchResult:
    """Launches torchrun with ``nproc`` ranks (1 chief, ``num_ps`` ps, the rest workers) and measures.

    Raises:
        ValueError: ``nproc`` leaves no worker.
        RuntimeError: the torchrun job failed (its stderr tail is in the message).
    """
    workers = nproc - 1 - num_ps
    if num_ps < 1 or workers < 1:
        raise ValueError(f"nproc={nproc} with num_ps={num_ps} leaves {workers} workers; need at least one")
    from torchstrategies.parameter_server.rpc.auth import with_job_secret

    env = with_job_secret(job_env())
    spec = {"num_ps": num_ps, "steps": steps, "warmup": warmup, "rounds": rounds, "batch": batch}
    data = run_job("torchstrategies.bench.train_ps", nproc, ["--spec", json.dumps(spec)], env, total=rounds,
                   desc="bench train (ps)", progress=progress)
    single = median(data["single"])
    ps = median(data["ps"])
    pulled = median([p for p, _ in data["traffic"]]) / steps
    pushed = median([q for _, q in data["traffic"]]) / steps
    rows = [
        {"runner": "single-process", "steps/s": steps / single, "samples/s": steps * batch / single,
         "ms/step": 1e3 * single / steps, "pulled B/step": 0, "pushed B/step": 0, "vs single": 1.0},
        {"runner": f"ps-async ({num_ps} ps x {workers} workers)", "steps/s": steps / ps,
         "samples/s": steps * batch / ps, "ms/step": 1e3 * ps / steps, "pulled B/step": pulled,
         "pushed B/step": pushed, "vs single": single / ps},
    ]
    import torch

    return BenchResult(
        title=f"ParameterServerStrategy throughput, MLP {'-'.join(map(str, SIZES))}, batch {batch}/step, "
              f"{nproc} processes",
        columns=["runner", "steps/s", "samples/s", "ms/step", "pulled B/step", "pushed B/step", "vs single"],
        rows=rows,
        notes=[f"median of {rounds} rounds of {steps} scheduled steps after {warmup} warm-up steps; one step = "
               f"one batch on one worker; torch {torch.__version__}, {os.cpu_count()} CPUs, "
               f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"],
        meta={"nproc": nproc, "num_ps": num_ps, "steps": steps, "rounds": rounds, "batch": batch, **data},
    )


def rows_for_train_table(result: BenchResult) -> list[dict[str, Any]]:
    """The ParameterServer row in ``bench/train.py``'s columns (runner, samples/s, ms/step), plus ours."""
    row = dict(result.rows[-1])
    row["runner"] = "ParameterServer " + row["runner"].split(" ", 1)[1]
    return [row]


def plot(result: BenchResult, path: str) -> None:
    """Bar chart of steps/s per runner."""
    bar_chart(result, path, "steps/s", references=("single-process",))


if __name__ == "__main__":  # the torchrun worker that run() launches
    _worker(*worker_spec())
