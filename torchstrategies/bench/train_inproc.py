"""In-process training rows of ``torchstrategies bench train``: strategy overhead and torch.compile.

Two groups, measured in the calling process (one intra-op thread unless OMP_NUM_THREADS says otherwise),
interleaved over ``rounds`` (medians):

* overhead: the MLP 64-64-10, global batch 32, SGD, ``zero_grad`` / forward / backward / step, under
  OneDeviceStrategy and MirroredStrategy with 1, 2 and 3 replicas, and as plain torch doing the same work:
  the global batch in N slices (one forward/backward per slice, gradients accumulated, one step; N = 1 is
  the ordinary full-batch step), loss ``sum / global batch`` as ``compute_average_loss`` computes it. The
  ``overhead us/replica`` column is ``(step time - plain torch N-slice step time) / N`` for N replicas:
  the strategy's own cost. ``above 1-pass torch us/replica`` is ``(step time - full-batch torch step) /
  N``, which also counts the extra forward/backward passes N replicas make on N smaller batches.
* compile: the MLP 784-1024-1024-10, global batch 64, as plain torch and MirroredStrategy(2) on CPU,
  eager and ``torch.compile``-d (the model compiled inside the scope). ``steps/s`` compares with TF 2.21
  MirroredStrategy's figure for the same model measured elsewhere.

Example:
    >>> from torchstrategies.bench import train_inproc
    >>> rows = train_inproc.rows(steps=5, warmup=2, rounds=1, groups=("overhead",))   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from torchstrategies.bench.report import median

__all__ = ["rows", "OVERHEAD_SIZES", "COMPILE_SIZES"]

OVERHEAD_SIZES = (64, 64, 10)
COMPILE_SIZES = (784, 1024, 1024, 10)


def _mlp(sizes: Sequence[int]) -> Any:
    import torch

    layers: list[Any] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _setup(kind: str, replicas: int, sizes: Sequence[int], batch: int, compiled: bool) -> Callable[[], None]:
    """One training step of ``kind`` ("torch", "one_device", "mirrored") as a no-argument function."""
    import torch

    import torchstrategies as ts

    torch.manual_seed(0)
    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))
    if kind == "torch":
        model = _mlp(sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        fwd = torch.compile(model) if compiled else model
        if replicas == 1:

            def plain() -> None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(fwd(x), y, reduction="none").sum().div(batch).backward()
                opt.step()

            return plain
        slices = list(zip(x.chunk(replicas), y.chunk(replicas), strict=True))

        def sliced() -> None:  # what N replicas compute, in one thread: N passes, one step
            opt.zero_grad()
            for xb, yb in slices:
                torch.nn.functional.cross_entropy(fwd(xb), yb, reduction="none").sum().div(batch).backward()
            opt.step()

        return sliced
    strategy: Any = (
        ts.OneDeviceStrategy("cpu") if kind == "one_device" else ts.MirroredStrategy(num_replicas=replicas)
    )
    with strategy.scope():
        model = _mlp(sizes)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        fwd = torch.compile(model) if compiled else model
    n = strategy.num_replicas_in_sync
    def split(t: Any) -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda c: t.chunk(n)[c.replica_id_in_sync_group]
        )

    xs, ys = split(x), split(y)

    def replica_step(xb: Any, yb: Any) -> None:
        opt.zero_grad()
        per_example = torch.nn.functional.cross_entropy(fwd(xb), yb, reduction="none")
        ts.compute_average_loss(per_example, global_batch_size=batch).backward()
        opt.step()

    def step() -> None:
        strategy.run(replica_step, args=(xs, ys))

    return step


def _time(step: Callable[[], None], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def rows(
    steps: int = 200,
    warmup: int = 20,
    rounds: int = 3,
    groups: Sequence[str] = ("overhead", "compile"),
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Measures the in-process rows; returns them in ``bench/train.py``'s table shape plus extra columns.

    ``threads``: torch intra-op threads for the measurement (restored afterwards); None keeps the current.
    """
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _rows(steps, warmup, rounds, groups)
    finally:
        torch.set_num_threads(before)


def _rows(steps: int, warmup: int, rounds: int, groups: Sequence[str]) -> list[dict[str, Any]]:
    cases: list[tuple[str, str, str, int, Sequence[int], int, bool]] = []
    s: Sequence[int]
    if "overhead" in groups:
        s = OVERHEAD_SIZES
        cases += [
            ("overhead", "in-process overhead: torch", "torch", 1, s, 32, False),
            ("overhead", "in-process overhead: torch, 2 slices", "torch", 2, s, 32, False),
            ("overhead", "in-process overhead: torch, 3 slices", "torch", 3, s, 32, False),
            ("overhead", "in-process overhead: OneDevice", "one_device", 1, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(1)", "mirrored", 1, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(2)", "mirrored", 2, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(3)", "mirrored", 3, s, 32, False),
        ]
    if "compile" in groups:
        s = COMPILE_SIZES
        cases += [
            ("compile", "in-process torch eager", "torch", 1, s, 64, False),
            ("compile", "in-process torch compiled", "torch", 1, s, 64, True),
            ("compile", "in-process Mirrored(2) eager", "mirrored", 2, s, 64, False),
            ("compile", "in-process Mirrored(2) compiled", "mirrored", 2, s, 64, True),
        ]
    steps_of = {"overhead": steps, "compile": max(1, steps // 10)}
    fns = {c[1]: _setup(c[2], c[3], c[4], c[5], c[6]) for c in cases}
    times: dict[str, list[float]] = {c[1]: [] for c in cases}
    for _ in range(rounds):
        for c in cases:
            times[c[1]].append(_time(fns[c[1]], steps_of[c[0]], warmup if c[0] == "overhead" else 3))
    plain = {  # plain torch doing the work of N replicas
        c[3]: median(times[c[1]]) for c in cases if c[0] == "overhead" and c[2] == "torch"
    }
    out = []
    for group, name, kind, replicas, _sizes, batch, _compiled in cases:
        t = median(times[name])
        row: dict[str, Any] = {"runner": name, "samples/s": batch / t, "ms/step": 1e3 * t, "steps/s": 1.0 / t}
        if group == "overhead" and kind != "torch":
            row["overhead us/replica"] = 1e6 * (t - plain[replicas]) / replicas
            row["above 1-pass torch us/replica"] = 1e6 * (t - plain[1]) / replicas
        out.append(row)
    return out
