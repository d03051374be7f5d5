"""``torchstrategies bench kernels | allreduce | train``: one front for the benchmark modules.

Each subcommand imports ``torchstrategies.bench.<name>`` when it runs, calls its ``run(...)`` with the
options the user gave (options left at their defaults are not passed, so the module's own defaults
apply), prints the BenchResult table, and writes ``--json FILE`` / ``--plot FILE.png`` on request.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import click

from torchstrategies.cli._common import SizeType, call_with_supported, emit_result, load_module

__all__ = ["bench", "run_bench"]

# CLI option -> parameter names a bench module's run() may use for it, first preferred.
ALIASES: dict[str, tuple[str, ...]] = {
    "n": ("ns", "n_values", "num_tensors", "n"),
    "kernel_sizes": ("sizes", "numels", "elements", "sizes_elements"),
    "message_sizes": ("sizes", "sizes_bytes", "message_sizes", "nbytes"),
    "impls": ("implementations", "impls", "implementation"),
    "strategies": ("strategies", "strategy"),
    "nproc": ("nproc", "world_size", "nproc_per_node"),
    "simulate_hosts": ("simulate_hosts",),
    "repeats": ("repeats", "rounds", "reps", "iters"),
    "steps": ("steps", "num_steps", "iters"),
    "batch_size": ("batch_size", "batch", "per_rank_batch_size"),
    "progress": ("progress",),
    "parameter_server": ("parameter_server",),
    "in_process": ("in_process",),
    "tf_python": ("tf_python",),
    "tf_inter_op": ("tf_inter_op",),
}

BENCH_MODULES = {
    "kernels": "torchstrategies.bench.kernels",
    "allreduce": "torchstrategies.bench.allreduce",
    "train": "torchstrategies.bench.train",
}


def run_bench(
    name: str, options: dict[str, Any], explicit: set[str], soft: AbstractSet[str] = frozenset()
) -> tuple[Any, Any]:
    """Runs bench ``name`` with ``options`` (keys of ALIASES); returns ``(result, module)``.

    Keys in ``explicit`` must be accepted by the module's ``run``; keys in ``soft`` (and ``progress``) are
    passed only if it accepts them; the others are left to the module's defaults.

    Raises:
        NotAvailable: the bench module is not in this build.
    """
    module = load_module(BENCH_MODULES[name])
    run: Callable[..., Any] | None = getattr(module, "run", None)
    if run is None:
        from torchstrategies.cli._common import NotAvailable

        raise NotAvailable(f"{module.__name__}.run")
    opts = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        mode: bool | None = (
            None if key == "progress" or (key in soft and key not in explicit) else key in explicit
        )
        opts.append((flag, ALIASES[key], value, mode))
    try:
        result = call_with_supported(run, f"{module.__name__}.run", opts)
    except click.ClickException:
        raise
    except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        # A benchmark that fails (a launch that died, a bad value) is one clear line, not a traceback.
        raise click.ClickException(f"{module.__name__}.run failed: {type(exc).__name__}: {exc}") from exc
    return result, module


def _explicit(ctx: click.Context, names: list[str]) -> set[str]:
    from click.core import ParameterSource

    return {n for n in names if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None)}


def _output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a chart (PNG).")(fn)
    fn = click.option(
        "--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON."
    )(fn)
    fn = click.option(
        "--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr."
    )(fn)
    return fn


@click.group()
def bench() -> None:
    """Benchmarks: kernels, all-reduce implementations, training throughput."""


@bench.command()
@click.option(
    "--n",
    "n",
    type=click.IntRange(1),
    multiple=True,
    help="Number of tensors summed (repeat: --n 2 --n 8). Default: the module's (2, 4, 8, 16).",
)
@click.option(
    "--size",
    "kernel_sizes",
    type=SizeType(),
    multiple=True,
    help="Elements per tensor, e.g. 64K, 1M, 16M (repeat for several).",
)
@click.option("--repeats", type=click.IntRange(1), default=None, help="Timed repetitions per point.")
@_output_options
@click.pass_context
def kernels(ctx: click.Context, n, kernel_sizes, repeats, progress, json_path, plot_path) -> None:
    """Time the aggregation kernels (add_n, add_ loop, stack+sum, tree_reduce, accumulate_n)."""
    opts = {"n": n, "kernel_sizes": kernel_sizes, "repeats": repeats, "progress": progress}
    result, module = run_bench("kernels", opts, _explicit(ctx, list(opts)))
    emit_result(result, module, json_path, plot_path)


@bench.command()
@click.option(
    "--nproc",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Ranks to launch (torchrun is started for you).",
)
@click.option(
    "--size",
    "message_sizes",
    type=SizeType(),
    multiple=True,
    help="Message size in bytes, e.g. 4KiB, 1MiB, 64MiB (repeat for several).",
)
@click.option(
    "--impl",
    "impls",
    multiple=True,
    help="Row to include (repeat): gloo, shm, shm-comm, shm-zero-copy, dist-backend (dist.all_reduce on a "
    "'torchstrategies' group), ring, hierarchical, auto, loopback-roofline (raw TCP bytes between the ranks). "
    "gloo is always added. Default: all but hierarchical and auto (with --simulate-hosts: gloo, ring, "
    "hierarchical, dist-backend, loopback-roofline).",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=None,
    help="Interleaved rounds; the median over them is reported (default 3).",
)
@click.option(
    "--simulate-hosts",
    "simulate_hosts",
    type=click.IntRange(1),
    default=None,
    help="Split the ranks into H simulated hosts (TORCHSTRATEGIES_HOST_ID per rank, nproc/H consecutive "
    "ranks each; H must divide --nproc), so HIERARCHICAL runs SHM inside a host and its inter-host "
    "stage between them. SHM rows are refused then.",
)
@_output_options
@click.pass_context
def allreduce(
    ctx: click.Context, nproc, message_sizes, impls, repeats, simulate_hosts, progress, json_path, plot_path
) -> None:
    """Time all-reduce implementations side by side (launches torchrun with --nproc ranks).

    Per size and implementation: median time, algbw = size/time, busbw = algbw * 2(n-1)/n (nccl-tests'
    definitions), the speed-up over gloo, and the fraction of the loopback roofline's busbw. Every case's
    sum is checked on every rank before it is timed. The title carries the machine and its load average.

    \b
    Example (gloo vs RING vs the roofline, 3 sizes, 5 rounds):
      torchstrategies bench allreduce --nproc 2 --impl gloo --impl ring --impl loopback-roofline \\
          --size 4KiB --size 1MiB --size 64MiB --repeats 5 --json ar.json
    """
    opts = {
        "nproc": nproc,
        "message_sizes": message_sizes,
        "impls": impls,
        "repeats": repeats,
        "simulate_hosts": simulate_hosts,
        "progress": progress,
    }
    explicit = _explicit(ctx, list(opts)) | {"nproc"}
    result, module = run_bench("allreduce", opts, explicit)
    emit_result(result, module, json_path, plot_path)


@bench.command()
@click.option(
    "--nproc",
    type=click.IntRange(1),
    default=2,
    show_default=True,
    help="Workers to launch (torchrun is started for you).",
)
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    help="Strategy / implementation row to include (repeat). Default: all the module knows.",
)
@click.option("--steps", type=click.IntRange(1), default=None, help="Training steps timed per row.")
@click.option("--batch-size", type=click.IntRange(1), default=None, help="Batch size per rank.")
@click.option("--repeats", type=click.IntRange(1), default=None, help="Timed rounds per row.")
@click.option(
    "--parameter-server/--no-parameter-server",
    default=False,
    help="Add a ParameterServerStrategy row (its own torchrun job: chief, 1 ps and the workers).",
)
@click.option(
    "--in-process/--no-in-process",
    default=True,
    help="Add the in-process rows: strategy overhead per replica (MLP 64-64-10) and MirroredStrategy(2) "
    "eager vs torch.compile (MLP 784-1024-1024-10).",
)
@click.option(
    "--tf-python",
    "tf_python",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A Python that has TensorFlow (e.g. a venv's bin/python): adds TF MirroredStrategy(2) and "
    "OneDeviceStrategy rows beside the compiled rows, and the column 'vs TF Mirrored(2)' from the same run. "
    "Default: $TORCHSTRATEGIES_TF_PYTHON if set, else no TF rows.",
)
@click.option(
    "--tf-inter-op",
    "tf_inter_op",
    type=click.IntRange(1),
    default=None,
    help="TF inter-op threads for the TF rows (default: one per replica; intra-op is the torch thread count).",
)
@_output_options
@click.pass_context
def train(
    ctx: click.Context, nproc, strategies, steps, batch_size, repeats, parameter_server, in_process, tf_python,
    tf_inter_op, progress, json_path, plot_path,
) -> None:
    """Training throughput (samples/s): torch DDP vs our strategies (launches torchrun)."""
    opts = {
        "nproc": nproc,
        "strategies": strategies,
        "steps": steps,
        "batch_size": batch_size,
        "repeats": repeats,
        "parameter_server": parameter_server,
        "in_process": in_process,
        "tf_python": tf_python,
        "tf_inter_op": tf_inter_op,
        "progress": progress,
    }
    explicit = _explicit(ctx, list(opts)) | {"nproc"}
    result, module = run_bench("train", opts, explicit, soft={"in_process"})
    emit_result(result, module, json_path, plot_path)
