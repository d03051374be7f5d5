"""What a few lines of Python cost right after a backward pass: ``python benchmarks/python_after_backward.py``.

MirroredStrategy's own work in a step (entering ``run``, handing the replica view from one replica to the
next, the merge) is Python that runs between torch's forward/backward passes. This measures how much more
the same Python costs there than in a tight loop, on the overhead benchmark's model (MLP 64-64-10, a batch
of 16, one thread): each snippet is timed in a loop ("hot"), right after a forward pass and right after a
backward pass, medians over ``--steps`` steps. Snippets: building the scheduler's per-run objects
(``mirrored_run._Run`` with its ``TorchState``), a 30-element list comprehension, and plain torch's
``optimizer.step()`` (SGD) called twice after a backward pass (first and second call).

Prints one line per snippet with the three medians in microseconds and the after-backward / hot ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import torchstrategies as ts
from torchstrategies.bench import train_inproc
from torchstrategies.distribute import mirrored_run


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(steps: int = 3000) -> list[tuple[str, float, float, float]]:
    """``(snippet, hot µs, after forward µs, after backward µs)`` per snippet."""
    torch.manual_seed(0)
    model = train_inproc._mlp(train_inproc.OVERHEAD_SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the model stays the same
    x = torch.randn(16, train_inproc.OVERHEAD_SIZES[0])
    y = torch.randint(0, train_inproc.OVERHEAD_SIZES[-1], (16,))
    strategy = ts.MirroredStrategy(num_replicas=2)
    clock = time.perf_counter

    def run_objects() -> None:
        mirrored_run._Run(strategy, 2, None, mirrored_run.TorchState())

    def list_comprehension() -> None:
        sum([i for i in range(30)])  # noqa: C416 - the snippet is the comprehension itself

    snippets: list[tuple[str, Callable[[], None]]] = [
        ("scheduler's per-run objects", run_objects),
        ("30-element list comprehension", list_comprehension),
    ]
    out = []
    for name, snippet in snippets:
        hot, after_fwd, after_bwd = [], [], []
        for _ in range(steps):
            t0 = clock()
            snippet()
            hot.append(clock() - t0)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t0 = clock()
            snippet()
            after_fwd.append(clock() - t0)
            loss.backward()
            t0 = clock()
            snippet()
            after_bwd.append(clock() - t0)
        out.append((name, _median_us(hot), _median_us(after_fwd), _median_us(after_bwd)))
    first, second = [], []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t0 = clock()
        opt.step()
        t1 = clock()
        opt.step()
        t2 = clock()
        first.append(t1 - t0)
        second.append(t2 - t1)
    out.append(("SGD optimizer.step(): 2nd call / 1st call after backward", _median_us(second), float("nan"),
                _median_us(first)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="steps per snippet (medians)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"{'snippet':58s} {'hot':>8s} {'after fwd':>10s} {'after bwd':>10s} {'bwd/hot':>8s}   (µs, medians)")
    for name, hot, fwd, bwd in measure(a.steps):
        print(f"{name:58s} {hot:8.2f} {fwd:10.2f} {bwd:10.2f} {bwd / hot:8.2f}")


if __name__ == "__main__":
    main()
