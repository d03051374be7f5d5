"""Stand-in bench modules for the CLI tests: they follow the shared bench interface
(``run(..., progress=True) -> BenchResult`` and ``plot(result, path)``) with known numbers, so the tests
check the CLI's wiring whether or not the real modules are in this build yet."""

from __future__ import annotations

import importlib.machinery
import sys
import types

from torchstrategies.bench.report import BenchResult

KERNEL_TIMES = {  # (kernel, N, elements) -> median ms; accumulate_n wins at 1M, tree_reduce at 1K
    ("add_n", 2, 1024): 0.05,
    ("tree_reduce", 2, 1024): 0.01,
    ("accumulate_n", 2, 1024): 0.02,
    ("add_n", 2, 1 << 20): 5.0,
    ("tree_reduce", 2, 1 << 20): 3.0,
    ("accumulate_n", 2, 1 << 20): 1.0,
    ("copy (roofline)", 2, 1024): 0.001,
    ("copy (roofline)", 2, 1 << 20): 0.1,
}
ALLREDUCE_TIMES = {  # (impl, bytes) -> median us; shm wins small, ring wins large
    ("gloo", 4096): 200.0,
    ("shm", 4096): 5.0,
    ("ring", 4096): 90.0,
    ("gloo", 1 << 20): 2000.0,
    ("shm", 1 << 20): 900.0,
    ("ring", 1 << 20): 700.0,
}


def _plot(result: BenchResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    fig.savefig(path)
    plt.close(fig)


def make_kernels(calls: list) -> types.ModuleType:
    def run(ns=(2,), sizes=(1024, 1 << 20), repeats=5, progress=True):
        calls.append({"ns": ns, "sizes": sizes, "repeats": repeats, "progress": progress})
        rows = [
            {"kernel": k, "N": n, "elements": s, "median (ms)": t}
            for (k, n, s), t in KERNEL_TIMES.items()
            if n in ns and s in sizes
        ]
        return BenchResult("aggregation kernels", ["kernel", "N", "elements", "median (ms)"], rows)

    return _module("torchstrategies.bench.kernels", run)


def make_allreduce(calls: list) -> types.ModuleType:
    def run(nproc=2, sizes=(4096, 1 << 20), implementations=None, progress=True, simulate_hosts=None):
        call = {"nproc": nproc, "sizes": sizes, "implementations": implementations}
        if simulate_hosts is not None:
            call["simulate_hosts"] = simulate_hosts
        calls.append(call)
        rows = [
            {"implementation": i, "size": f"{s // 1024} KiB", "median": f"{t} us"}
            for (i, s), t in ALLREDUCE_TIMES.items()
            if s in sizes
        ]
        return BenchResult(f"all-reduce, {nproc} ranks", ["implementation", "size", "median"], rows)

    return _module("torchstrategies.bench.allreduce", run)


def make_train(calls: list) -> types.ModuleType:
    def run(nproc=2, strategies=None, steps=10, progress=True):
        calls.append({"nproc": nproc, "strategies": strategies, "steps": steps})
        rows = [{"strategy": s, "samples/s": 100.0 + i} for i, s in enumerate(strategies or ["ddp", "ours"])]
        return BenchResult("training throughput", ["strategy", "samples/s"], rows)

    mod = _module("torchstrategies.bench.train", run)
    del mod.plot  # a module without plot(): --plot must say it is not available
    return mod


def make_train_ps(calls: list) -> types.ModuleType:
    def run(nproc=4, num_ps=1, steps=100, rounds=3, batch=64, progress=True):
        calls.append({"nproc": nproc, "num_ps": num_ps, "steps": steps, "rounds": rounds, "batch": batch})
        rows = [{"runner": "single-process", "steps/s": 10.0}, {"runner": "ps-async", "steps/s": 5.0}]
        return BenchResult("ps throughput", ["runner", "steps/s"], rows)

    return _module("torchstrategies.bench.train_ps", run)


def _module(name: str, run) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.run = run
    mod.plot = _plot
    return mod


def install(monkeypatch, *names: str) -> dict[str, list]:
    """Puts fake bench modules into sys.modules (restored after the test); returns their call logs."""
    makers = {"kernels": make_kernels, "allreduce": make_allreduce, "train": make_train, "train-ps": make_train_ps}
    calls: dict[str, list] = {}
    for n in names:
        calls[n] = []
        mod = makers[n](calls[n])
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return calls


def hide(monkeypatch, *names: str) -> None:
    """Makes bench modules look absent from this build."""
    from torchstrategies.cli import bench_cmds

    for n in names:
        monkeypatch.setitem(bench_cmds.BENCH_MODULES, n, f"torchstrategies.bench._absent_{n}")
