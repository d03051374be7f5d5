"""``torchstrategies compare``: every aggregation kernel and every all-reduce implementation on this
machine, and which to use for which size (the data AUTO is built from), with a plot.

It runs ``bench kernels`` and ``bench allreduce`` (or reads their ``--json`` output with
``--kernels-from`` / ``--allreduce-from``), finds the winner at every size with
:mod:`torchstrategies.cli.recommend`, prints one table of advice plus the size ranges per winner, and
draws both benchmarks' curves in one PNG. Its options are declared in ``torchstrategies_cli``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from torchstrategies.cli._common import NotAvailable, module_available
from torchstrategies.cli.bench_cmds import BENCH_MODULES, run_bench
from torchstrategies.cli.recommend import Winner, detect_roles, series, size_ranges, winners

if TYPE_CHECKING:
    from torchstrategies.bench.report import BenchResult

__all__ = ["compare", "advice", "plot_compare"]

ADVICE_COLUMNS = ["bench", "group", "size", "use", "metric", "runner-up", "margin"]


def advice(sources: dict[str, BenchResult]) -> BenchResult:
    """One BenchResult of advice from ``{"kernels": BenchResult, "allreduce": BenchResult}`` (either may
    be missing); notes hold the merged size ranges per winner."""
    from torchstrategies.bench.report import BenchResult

    out = BenchResult("Which to use, by size (fastest on this machine)", list(ADVICE_COLUMNS))
    for bench_name, result in sources.items():
        roles = detect_roles(result)
        ws = winners(result, roles)
        label = f"by {roles.metric}, {'lower' if roles.minimize else 'higher'} is better"
        for w in ws:
            out.rows.append(
                {
                    "bench": bench_name,
                    "group": "" if w.group is None else f"{roles.group}={w.group}",
                    "size": w.size_label,
                    "use": w.best,
                    "metric": w.best_value,
                    "runner-up": w.runner_up or "",
                    "margin": "" if w.margin is None else f"{w.margin:.2f}x",
                }
            )
        groups: dict[object, list[Winner]] = {}
        for w in ws:
            groups.setdefault(w.group, []).append(w)
        for g, gws in groups.items():
            ranges = ", ".join(
                f"{a}..{b}: {impl}" if a != b else f"{a}: {impl}" for a, b, impl in size_ranges(gws)
            )
            where = "" if g is None else f" {roles.group}={g}"
            out.notes.append(f"{bench_name}{where}: {ranges}   ({label})")
        out.meta[bench_name] = {"roles": roles.__dict__, "source_title": result.title}
    return out


def plot_compare(sources: dict[str, BenchResult], path: str) -> None:
    """Draws each source's metric against size (log-log), one panel per benchmark, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, max(1, len(sources)), figsize=(6.5 * max(1, len(sources)), 4.5), squeeze=False
    )
    for ax, result in zip(axes[0], sources.values(), strict=False):
        roles = detect_roles(result)
        data = series(result, roles)
        # One group per panel: the largest (e.g. the largest N), where the kernels differ most.
        group = (
            max(data, key=lambda g: (g is not None, str(g).isdigit() and int(str(g)), str(g))) if data else None
        )
        for impl, pts in sorted((data.get(group) or {}).items()):
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(roles.size)
        ax.set_ylabel(roles.metric + (" (lower is better)" if roles.minimize else " (higher is better)"))
        title = result.title + ("" if group is None else f" ({roles.group}={group})")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_json(path: str) -> BenchResult:
    from torchstrategies.bench.report import BenchResult

    try:
        return BenchResult.read_json(path)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _at_one_thread_count(result: BenchResult) -> BenchResult:
    """A kernels result measured at several thread counts (a ``threads`` column) keeps only the rows at
    its default count (``meta["default_threads"]``, else the largest), so each (N, size) race compares
    methods at one thread count; other results are returned as they are."""
    counts: set[int] = {row["threads"] for row in result.rows} if "threads" in result.columns else set()
    if len(counts) < 2:
        return result
    keep = (result.meta or {}).get("default_threads")
    keep = keep if keep in counts else max(counts)
    result.rows = [row for row in result.rows if row.get("threads") == keep]
    result.notes = [*result.notes, f"compare: the rows at {keep} thread(s) (of {sorted(counts)})"]
    return result


def _sources(
    explicit: Callable[..., set[str]],
    nproc: int,
    n: tuple[int, ...],
    kernel_sizes: tuple[int, ...],
    message_sizes: tuple[int, ...],
    repeats: int | None,
    kernels_from: str | None,
    allreduce_from: str | None,
    progress: bool,
) -> tuple[dict[str, BenchResult], list[str]]:
    """The two results to advise from (read from ``--*-from`` files or run now) and the modules skipped."""
    sources: dict[str, BenchResult] = {}
    skipped: list[str] = []
    if kernels_from:
        sources["kernels"] = _at_one_thread_count(_load_json(kernels_from))
    elif module_available(BENCH_MODULES["kernels"]):
        import torch

        # The race is at the thread count this process runs with (bench kernels alone also adds 1 thread).
        opts: dict[str, object] = {"n": n, "kernel_sizes": kernel_sizes, "repeats": repeats,
                                   "threads": (torch.get_num_threads(),), "progress": progress}
        result, _ = run_bench("kernels", opts, explicit("n", "kernel_sizes", "repeats"), soft={"threads"})
        sources["kernels"] = _at_one_thread_count(result)
    else:
        skipped.append(BENCH_MODULES["kernels"])
    if allreduce_from:
        sources["allreduce"] = _load_json(allreduce_from)
    elif module_available(BENCH_MODULES["allreduce"]):
        opts = {"nproc": nproc, "message_sizes": message_sizes, "repeats": repeats, "progress": progress}
        # --repeats goes to the all-reduce benchmark only if its run() takes it (it may not).
        sources["allreduce"], _ = run_bench(
            "allreduce", opts, explicit("message_sizes") | {"nproc"}, soft=explicit("repeats")
        )
    else:
        skipped.append(BENCH_MODULES["allreduce"])
    if not sources:
        raise NotAvailable(" and ".join(skipped))
    return sources, skipped


def compare(
    ctx: click.Context,
    nproc,
    n,
    kernel_sizes,
    message_sizes,
    repeats,
    kernels_from,
    allreduce_from,
    json_path,
    plot_path,
    no_plot,
    progress,
) -> None:
    """``torchstrategies compare`` (options: ``torchstrategies_cli``): runs or reads both benchmarks and prints
    which to use for which size."""
    from click.core import ParameterSource

    def explicit(*names: str) -> set[str]:
        return {x for x in names if ctx.get_parameter_source(x) is not ParameterSource.DEFAULT}

    sources, skipped = _sources(explicit, nproc, n, kernel_sizes, message_sizes, repeats, kernels_from,
                                allreduce_from, progress)
    for result in sources.values():
        result.print()
    try:
        table = advice(sources)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    table.notes.extend(f"not available in this build: {s} (skipped)" for s in skipped)
    table.print()
    if json_path:
        payload = {"advice": table.to_dict(), "results": {k: v.to_dict() for k, v in sources.items()}}
        with open(json_path, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        click.echo(f"results written to {json_path}")
    if not no_plot:
        plot_compare(sources, plot_path)
        click.echo(f"plot written to {plot_path}")
