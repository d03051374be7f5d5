"""Kernel benchmark: summing N float32 tensors with our kernels vs torch baselines, against memory roofline.

Every row is measured at each of several torch thread counts (default: 1 and torch's current count, which
is its default unless changed), every method alike, so the table shows both the one-thread kernels and
the split over torch's intra-op pool. For every (N, elements, threads) it times, interleaved round by
round so machine noise hits all alike:

- ``add_n``: TF's ADD_N baseline, ``ts.ops.add_n`` (sequential ``a + b``, allocates each step);
- ``add_ loop``: ``out.copy_(t0)`` then ``out.add_(t)`` for the rest, into a preallocated ``out``;
- ``stack+sum``: ``torch.stack(ts).sum(0)``;
- ``tree_reduce`` and ``accumulate_n``: our one-pass kernels, into the same preallocated ``out``;
- ``hash_tensors``: the agreement seam's fingerprint of the same N tensors in one call (``ts.ops.hash_tensors``,
  docs/strategies.md "Agreement"); it only reads, so its ``GB/s`` is ``N * bytes / time``;

and the memory roofline of the same run, ``dst.copy_(src)`` at that size and thread count (the best of
its rounds). Effective bandwidth counts each input read once and the output written once:
``GB/s = (N + 1) * bytes / time`` (``hash_tensors``, which writes no output: ``N * bytes / time``); the
roofline is ``2 * bytes / time`` of the copy.

Columns (short, so the table fits 80 characters): ``threads``; ``N``; ``elements``; ``method``; ``ms``, the
median time per call; ``GB/s``; ``% roof``, the GB/s as a percentage of the copy roofline at the same size
and thread count; ``x loop``, the speed-up over the add_ loop (its time over the method's) at the same
thread count.

Example:
    >>> from torchstrategies.bench import kernels
    >>> r = kernels.run(ns=(2,), sizes=(1024,), repeats=3, progress=False, threads=(1, 2))
    >>> sorted({row["method"] for row in r.rows})[:2]
    ['accumulate_n', 'add_ loop']
    >>> sorted({row["threads"] for row in r.rows})
    [1, 2]
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchstrategies import ops
from torchstrategies.bench.report import BenchResult, median
from torchstrategies.env_info import cpu_model

__all__ = ["run", "plot", "thread_counts", "METHODS", "COLUMNS"]

METHODS = ("add_n", "add_ loop", "stack+sum", "tree_reduce", "accumulate_n", "hash_tensors")
_READ_ONLY = {"hash_tensors"}  # writes no output: its bytes are the N inputs
COLUMNS = ["threads", "N", "elements", "method", "ms", "GB/s", "% roof", "x loop"]


def _methods(xs: list[torch.Tensor], out: torch.Tensor) -> dict[str, Callable[[], Any]]:
    def add_loop() -> None:
        out.copy_(xs[0])
        for t in xs[1:]:
            out.add_(t)

    return {
        "add_n": lambda: ops.add_n(xs),
        "add_ loop": add_loop,
        "stack+sum": lambda: torch.stack(xs).sum(0),
        "tree_reduce": lambda: ops.tree_reduce(xs, out=out),
        "accumulate_n": lambda: ops.accumulate_n(xs, out=out),
        "hash_tensors": lambda: ops.hash_tensors(xs),
    }


def _inner_calls(fn: Callable[[], Any], target_s: float = 2e-3) -> int:
    """Calls per timed sample so that one sample lasts about target_s (short kernels are batched)."""
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(1000, int(target_s / dt)))


def _time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each fn, sampled round-robin (one sample of each per round)."""
    inner = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        inner[name] = _inner_calls(fn)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            k = inner[name]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t0) / k)
    return {name: median(s) for name, s in samples.items()}


def thread_counts(threads: int | Sequence[int] | None = None) -> list[int]:
    """The thread counts a run measures: ``threads`` (an int or several, duplicates dropped), or by
    default 1 and torch's current count (once if that is 1).

    Raises:
        ValueError: an empty list or a count below 1.
    """
    if threads is None:
        return sorted({1, torch.get_num_threads()})
    counts = [threads] if isinstance(threads, int) else list(threads)
    if not counts or any(not isinstance(t, int) or t < 1 for t in counts):
        raise ValueError(f"threads must be one or more integers >= 1, got {threads!r}")
    return list(dict.fromkeys(counts))


def run(
    ns: Sequence[int] = (2, 4, 8, 16),
    sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24),
    repeats: int = 15,
    progress: bool = True,
    seed: int = 0,
    threads: int | Sequence[int] | None = None,
) -> BenchResult:
    """Times the methods for every N in ``ns``, element count in ``sizes`` and thread count (float32, CPU).

    Args:
        ns: numbers of tensors summed.
        sizes: elements per tensor.
        repeats: timed rounds per (N, size, threads); the table reports the median.
        progress: show a progress bar on stderr.
        seed: for the random inputs.
        threads: torch intra-op thread counts to measure at (all methods and the roofline alike): an int
            or several; None: 1 and torch's current count. torch's setting is restored afterwards.

    Returns:
        A BenchResult with one row per (threads, N, size, method); ``meta["roofline_gbps"]`` maps each
        thread count to {size: the best copy bandwidth measured at that size and thread count}.

    Raises:
        ValueError: empty ``ns`` / ``sizes``, ``repeats`` < 1, or a thread count below 1.
    """
    if not ns or not sizes or repeats < 1:
        raise ValueError(f"need non-empty ns and sizes and repeats >= 1, got {ns=}, {sizes=}, {repeats=}")
    counts = thread_counts(threads)
    previous = torch.get_num_threads()
    try:
        return _run(ns, sizes, repeats, progress, seed, counts, previous)
    finally:
        torch.set_num_threads(previous)


def _run(ns: Sequence[int], sizes: Sequence[int], repeats: int, progress: bool, seed: int, counts: list[int],
         default_threads: int) -> BenchResult:
    from torchstrategies.bench import report

    g = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    roofline: dict[int, dict[int, float]] = {t: {} for t in counts}
    cases = [(n, size) for size in sizes for n in ns]
    for n, size in report.progress(cases, "kernels", total=len(cases), enabled=progress):
        xs = [torch.randn(size, generator=g) for _ in range(n)]
        out = torch.empty(size)
        src, dst = torch.randn(size, generator=g), torch.empty(size)
        fns: dict[str, Any] = {"copy": lambda d=dst, s=src: d.copy_(s), **_methods(xs, out)}
        nbytes = size * 4
        for threads in counts:
            torch.set_num_threads(threads)
            t = _time_interleaved(fns, repeats)
            roof = roofline[threads]
            roof[size] = max(roof.get(size, 0.0), 2 * nbytes / t["copy"] / 1e9)
            for name in METHODS:
                rows.append({"threads": threads, "N": n, "elements": size, "method": name, "ms": t[name] * 1e3,
                             "GB/s": (n + (name not in _READ_ONLY)) * nbytes / t[name] / 1e9,
                             "x loop": t["add_ loop"] / t[name]})
        del xs, out, src, dst, fns
    # The roofline of a (threads, size) is the best copy bandwidth measured there in this run (conservative:
    # a noisy round cannot inflate a method's percentage).
    for row in rows:
        row["% roof"] = 100 * row["GB/s"] / roofline[row["threads"]][row["elements"]]
    rows.sort(key=lambda r: r["threads"])  # stable: one block of rows per thread count
    notes = [f"roofline (dst.copy_(src), 2*bytes/time) at {t} thread(s), {s} elements: {gb:.1f} GB/s"
             for t, per_size in roofline.items() for s, gb in per_size.items()]
    notes.append("ms = median per call; GB/s = (N+1)*bytes/time (hash_tensors: N*bytes/time); "
                 "% roof = 100 * that / the best copy GB/s at "
                 "that size and thread count in this run; x loop = the add_ loop's time at the same thread count "
                 "/ the method's")
    meta = {
        "torch": torch.__version__, "threads": counts, "default_threads": default_threads,
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "processor": cpu_model(), "repeats": repeats,
        "loadavg": _loadavg(), "roofline_gbps": roofline, "dtype": "float32",
        "roles": {"impl": "method", "size": "elements", "time": "ms", "group": "N"},  # for compare
        # rows that compute something else than the sum (the hash: a reference figure), never advised
        "baselines": sorted(_READ_ONLY),
    }
    return BenchResult("Summing N float32 tensors (CPU)", list(COLUMNS), rows, notes, meta)


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def plot(result: BenchResult, path: str) -> None:
    """Draws GB/s against N, one panel per (thread count, size), one line per method, the copy roofline
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["elements"] for r in result.rows})
    counts = sorted({r.get("threads", 1) for r in result.rows})
    fig, axes = plt.subplots(len(counts), len(sizes), figsize=(5 * len(sizes), 4 * len(counts)), squeeze=False)
    roofs = {int(t): {int(k): v for k, v in per.items()} for t, per in result.meta.get("roofline_gbps", {}).items()}
    for ax_row, threads in zip(axes, counts):
        for ax, size in zip(ax_row, sizes):
            here = [r for r in result.rows if r["elements"] == size and r.get("threads", 1) == threads]
            for method in METHODS:
                pts = sorted((r["N"], r["GB/s"]) for r in here if r["method"] == method)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            if size in roofs.get(threads, {}):
                ax.axhline(roofs[threads][size], linestyle="--", color="gray", label="copy roofline")
            ax.set_title(f"{size:,} float32 elements, {threads} thread(s)")
            ax.set_xlabel("N tensors")
            ax.set_ylabel("effective GB/s")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(result.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
