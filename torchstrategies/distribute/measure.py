"""Measures the distribute core's defaults: ``python -m torchstrategies.distribute.measure``.

1. ``ReductionToOneDevice``'s default ``accumulation_fn``: time to sum N gradient-sized CPU tensors with
   each AggregationMethod (median of repeats), as ratios to ADD_N measured in the same run.
2. The per-step overhead of MirroredStrategy's threaded replicas against the same model trained plainly.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["measure_aggregation", "measure_step_overhead", "main"]


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_aggregation(
    sizes: tuple[int, ...] = (1_000, 100_000, 4_000_000),
    replicas: tuple[int, ...] = (2, 3, 4),
    repeats: int = 15,
) -> list[tuple[int, int, dict[str, float]]]:
    from torchstrategies.aggregation import AggregationMethod
    from torchstrategies.distribute.cross_device_ops import ReductionToOneDevice
    from torchstrategies.distribute.values import PerReplica

    rows = []
    for n in replicas:
        for size in sizes:
            value = PerReplica(tuple(torch.randn(size) for _ in range(n)))
            res = {}
            for m in list(AggregationMethod)[:3]:
                ops = ReductionToOneDevice(accumulation_fn=m)
                def run(ops: ReductionToOneDevice = ops, v: PerReplica = value) -> object:
                    return ops.reduce("sum", v, "cpu")

                res[m.name] = _median_time(run, repeats)
            rows.append((n, size, res))
    return rows


def measure_step_overhead(replicas: int = 2, steps: int = 40, batch: int = 128) -> tuple[float, float]:
    """CPU seconds (process time, all threads) per training step: plain torch vs MirroredStrategy."""
    import torchstrategies as ts

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )

    def cpu_time(fn: Callable[[], object]) -> float:
        fn()
        fn()
        t0 = time.process_time()
        for _ in range(steps):
            fn()
        return (time.process_time() - t0) / steps

    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    model = build()
    opt = torch.optim.Adam(model.parameters())

    def plain() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    s = ts.MirroredStrategy(num_replicas=replicas)
    with s.scope():
        dmodel = build()
        dopt = torch.optim.Adam(dmodel.parameters())
    ((xb, yb),) = list(s.experimental_distribute_dataset([(x, y)]))

    def step(a: torch.Tensor, b: torch.Tensor) -> None:
        dopt.zero_grad()
        ts.compute_average_loss(torch.nn.functional.cross_entropy(dmodel(a), b, reduction="none")).backward()
        dopt.step()

    return cpu_time(plain), cpu_time(lambda: s.run(step, args=(xb, yb)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: stable on shared machines)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("ReductionToOneDevice SUM on CPU, median seconds (ratio to ADD_N)")
    print(
        f"{'N':>2} {'elements':>10}  {'ADD_N':>10}  {'EXPERIMENTAL_TREE':>22}  "
        f"{'EXPERIMENTAL_ACCUMULATE_N':>26}"
    )
    for n, size, res in measure_aggregation(repeats=args.repeats):
        base = res["ADD_N"]
        print(
            f"{n:>2} {size:>10}  {base:10.2e}  {res['EXPERIMENTAL_TREE']:10.2e} "
            f"({res['EXPERIMENTAL_TREE'] / base:5.2f}x)"
            f"  {res['EXPERIMENTAL_ACCUMULATE_N']:10.2e} ({res['EXPERIMENTAL_ACCUMULATE_N'] / base:5.2f}x)"
        )
    print(
        "Training step, CPU ms per step (global batch 128, 64-256-256-10 MLP, Adam), "
        f"torch threads = {torch.get_num_threads()}"
    )
    for n in (1, 2, 4):
        tp, td = measure_step_overhead(replicas=n)
        print(f"  MirroredStrategy x{n}: {td * 1e3:.2f} ms vs plain {tp * 1e3:.2f} ms ({td / tp:.2f}x)")


if __name__ == "__main__":
    main()
