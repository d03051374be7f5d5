"""Training throughput of ParameterServerStrategy: ``python -m torchstrategies.bench.train_ps --nproc 4``.

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
import sys
import tempfile
import time
from typing import Any

from torchstrategies.bench.launch import run_torchrun
from torchstrategies.bench.report import BenchResult, median

__all__ = ["run", "plot", "rows_for_train_table", "main"]

SIZES = (784, 1024, 1024, 10)


def _mlp():
    import torch

    layers: list[Any] = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(batch: int, n: int = 8, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (batch,), generator=g))
            for _ in range(n)]


def _chief(resolver, args: dict[str, Any]) -> dict[str, Any]:
    import torch

    import torchstrategies as ts

    steps, warmup, rounds, batch = args["steps"], args["warmup"], args["rounds"], args["batch"]
    data = _batches(batch)

    # Single-process baseline, same model, same steps.
    torch.manual_seed(0)
    local = _mlp()
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
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    coordinator = ts.coordinator.ClusterCoordinator(strategy)

    def step(x, y):
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


def _worker(args: dict[str, Any]) -> None:
    import torch

    import torchstrategies as ts
    from torchstrategies.parameter_server import Server

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=args["num_ps"])
    if resolver.task_type != "chief":
        Server(resolver).join()
        return
    out = _chief(resolver, args)
    with open(args["json"], "w") as f:
        json.dump(out, f)


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
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spec = json.dumps({"num_ps": num_ps, "steps": steps, "warmup": warmup, "rounds": rounds, "batch": batch,
                           "json": out})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "torchstrategies.bench.train_ps", "--worker", spec]
        from torchstrategies.parameter_server.rpc.auth import with_job_secret

        env = with_job_secret(dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                                   PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path)))
        run_torchrun(cmd, env, total=rounds, desc="bench train (ps)", progress=progress)
        with open(out) as f:
            data = json.load(f)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["runner"] for r in result.rows]
    rates = [r["steps/s"] for r in result.rows]
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.barh(names, rates, color=["#888", "#3a7"][: len(names)])
    ax.set_xlabel("steps/s (higher is better)")
    ax.set_title(result.title, fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    a = p.parse_args(argv)
    if a.worker:
        _worker(json.loads(a.worker))
        return
    result = run(nproc=a.nproc, num_ps=a.num_ps, steps=a.steps, rounds=a.rounds, batch=a.batch)
    result.print()
    if a.json:
        result.write_json(a.json)
    if a.plot:
        plot(result, a.plot)


if __name__ == "__main__":
    main()
