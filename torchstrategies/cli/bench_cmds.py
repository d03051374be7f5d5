"""``torchstrategies bench kernels | allreduce | train | train-ps | inproc``: the one way to run a benchmark.

Each subcommand imports ``torchstrategies.bench.<name>`` when it runs, calls its ``run(...)`` with the
options the user gave (options left at their defaults are not passed, so the module's own defaults
apply), and hands the BenchResult to :func:`~torchstrategies.cli._common.emit_result`, which prints the
table (``--markdown`` too) and writes ``--json FILE`` / ``--plot FILE.png`` on request.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from types import ModuleType
from typing import TYPE_CHECKING

import click

from torchstrategies.cli._common import (
    ApiGroup,
    NotAvailable,
    call_with_supported,
    count_option,
    emit_result,
    load_module,
    nproc_option,
    output_options,
    repeats_option,
    sizes_option,
)

if TYPE_CHECKING:
    from torchstrategies.bench.report import BenchResult

__all__ = ["bench", "run_bench"]

# CLI option -> the parameter names a bench module's run() may take it as, first preferred, where they differ
# from the option's own name (repeats: kernels' "repeats", the others' interleaved "rounds").
ALIASES: dict[str, tuple[str, ...]] = {
    "n": ("ns",),
    "kernel_sizes": ("sizes",),
    "message_sizes": ("sizes",),
    "impls": ("implementations",),
    "repeats": ("repeats", "rounds"),
    "batch_size": ("batch",),
}

BENCH_MODULES = {
    "kernels": "torchstrategies.bench.kernels",
    "allreduce": "torchstrategies.bench.allreduce",
    "train": "torchstrategies.bench.train",
    "train-ps": "torchstrategies.bench.train_ps",
    "inproc": "torchstrategies.bench.train_inproc",
}


def run_bench(
    name: str, options: dict[str, object], explicit: AbstractSet[str], soft: AbstractSet[str] = frozenset()
) -> tuple[BenchResult, ModuleType]:
    """Runs bench ``name`` with ``options`` (the CLI option names; ALIASES maps them to ``run``'s); returns
    ``(result, module)``.

    Keys in ``explicit`` must be accepted by the module's ``run``; keys in ``soft`` (and ``progress``) are
    passed only if it accepts them; the others are left to the module's defaults.

    Raises:
        NotAvailable: the bench module is not in this build.
    """
    module = load_module(BENCH_MODULES[name])
    run: Callable[..., BenchResult] | None = getattr(module, "run", None)
    if run is None:
        raise NotAvailable(f"{module.__name__}.run")
    opts = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        mode: bool | None = (
            None if key == "progress" or (key in soft and key not in explicit) else key in explicit
        )
        opts.append((flag, ALIASES.get(key, (key,)), value, mode))
    try:
        result = call_with_supported(run, f"{module.__name__}.run", opts)
    except click.ClickException:
        raise
    except ValueError as exc:
        # The module refused a value the user gave (an unknown row, sizes that do not fit): a usage error.
        raise click.UsageError(f"{module.__name__}.run: {exc}") from exc
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        # A benchmark that fails (a launch that died, a bad value) is one clear line, not a traceback.
        raise click.ClickException(f"{module.__name__}.run failed: {type(exc).__name__}: {exc}") from exc
    return result, module


def _run_and_emit(
    ctx: click.Context,
    name: str,
    options: dict[str, object],
    *,
    always: AbstractSet[str] = frozenset(),
    soft: AbstractSet[str] = frozenset(),
) -> None:
    """Runs bench ``name`` with the command's options (those the user set, plus ``always``) and reports it
    through ``emit_result`` with the command's ``--json`` / ``--plot`` / ``--markdown``."""
    from click.core import ParameterSource

    explicit = {k for k in options if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    result, module = run_bench(name, options, explicit | always, soft=soft)
    p = ctx.params
    emit_result(result, module, p["json_path"], p["plot_path"], p["markdown"])


@click.group(cls=ApiGroup)
def bench() -> None:
    """Benchmarks: kernels, all-reduce implementations, training throughput."""


@bench.command()
@count_option("--n", "n", "Number of tensors summed (repeat: --n 2 --n 8). Default: the module's (2, 4, 8, 16).",
              multiple=True)
@sizes_option("--size", "kernel_sizes", "Elements per tensor, e.g. 64K, 1M, 16M (repeat for several).")
@repeats_option()
@count_option("--threads", "threads", "torch thread count to measure every row at (repeat: --threads 1 --threads "
              "4). Default: 1 and torch's default.", multiple=True)
@output_options
@click.pass_context
def kernels(ctx: click.Context, n, kernel_sizes, repeats, threads, progress, **_) -> None:
    """Time the aggregation kernels (add_n, add_ loop, stack+sum, tree_reduce, accumulate_n), each at 1
    thread and at torch's default thread count, against the copy roofline at the same thread count."""
    opts = {"n": n, "kernel_sizes": kernel_sizes, "repeats": repeats, "threads": threads, "progress": progress}
    _run_and_emit(ctx, "kernels", opts)


@bench.command()
@nproc_option("Ranks to launch (torchrun is started for you).")
@sizes_option("--size", "message_sizes", "Message size in bytes, e.g. 4KiB, 1MiB, 64MiB (repeat for several).")
@click.option(
    "--impl",
    "impls",
    multiple=True,
    help="Row to include (repeat): gloo, shm, shm-comm, shm-zero-copy, dist-backend (dist.all_reduce on a "
    "'torchstrategies' group), ring, hierarchical, auto, loopback-roofline (raw TCP bytes between the ranks). "
    "gloo is always added. Default: all but hierarchical and auto (with --simulate-hosts: gloo, ring, "
    "hierarchical, dist-backend, loopback-roofline).",
)
@repeats_option("Interleaved rounds; the median over them is reported (default 3).")
@count_option("--simulate-hosts", "simulate_hosts", "Split the ranks into H simulated hosts "
              "(TORCHSTRATEGIES_HOST_ID per rank, nproc/H consecutive ranks each; H must divide --nproc), so "
              "HIERARCHICAL runs SHM inside a host and its inter-host stage between them. SHM rows are refused "
              "then.")
@output_options
@click.pass_context
def allreduce(ctx: click.Context, nproc, message_sizes, impls, repeats, simulate_hosts, progress, **_) -> None:
    """Time all-reduce implementations side by side (launches torchrun with --nproc ranks).

    Per size and implementation: median time, algbw = size/time, busbw = algbw * 2(n-1)/n (nccl-tests'
    definitions), the speed-up over gloo, and the fraction of the loopback roofline's busbw. Every case's
    sum is checked on every rank before it is timed. The title carries the machine and its load average.

    \b
    Example (gloo vs RING vs the roofline, 3 sizes, 5 rounds):
      torchstrategies bench allreduce --nproc 2 --impl gloo --impl ring --impl loopback-roofline \\
          --size 4KiB --size 1MiB --size 64MiB --repeats 5 --json ar.json
    """
    opts = {"nproc": nproc, "message_sizes": message_sizes, "impls": impls, "repeats": repeats,
            "simulate_hosts": simulate_hosts, "progress": progress}
    _run_and_emit(ctx, "allreduce", opts, always={"nproc"})


def _tf_options(fn: Callable[..., None]) -> Callable[..., None]:
    """``--tf-python`` and ``--tf-inter-op``: the TF rows of ``bench train`` and ``bench inproc``."""
    fn = count_option("--tf-inter-op", "tf_inter_op", "TF inter-op threads for the TF rows (default: as many "
                      "as the torch threads, at most one per replica; TF computes on as many threads as torch: "
                      "intra-op = torch threads // inter-op).")(fn)
    return click.option(
        "--tf-python",
        "tf_python",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="A Python that has TensorFlow (e.g. a venv's bin/python): adds TF MirroredStrategy(2) and "
        "OneDeviceStrategy rows beside the compiled rows, and the column 'vs TF Mirrored(2)' from the same "
        "run. Default: $TORCHSTRATEGIES_TF_PYTHON if set (bench train), else no TF rows.",
    )(fn)


@bench.command()
@nproc_option("Workers to launch (torchrun is started for you).")
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    help="Strategy / implementation row to include (repeat). Default: all the module knows.",
)
@count_option("--steps", "steps", "Training steps timed per row.")
@count_option("--batch-size", "batch_size", "Batch size per rank.")
@repeats_option("Timed rounds per row.")
@click.option(
    "--parameter-server/--no-parameter-server",
    default=False,
    help="Add a ParameterServerStrategy row (its own torchrun job: chief, 1 ps and the workers).",
)
@click.option(
    "--in-process/--no-in-process",
    default=True,
    help="Add the in-process rows (bench inproc): strategy overhead per replica (MLP 64-64-10) and "
    "MirroredStrategy(2) eager vs torch.compile (MLP 784-1024-1024-10).",
)
@_tf_options
@output_options
@click.pass_context
def train(
    ctx: click.Context, nproc, strategies, steps, batch_size, repeats, parameter_server, in_process, tf_python,
    tf_inter_op, progress, **_,
) -> None:
    """Training throughput (samples/s): torch DDP vs our strategies (launches torchrun)."""
    opts = {"nproc": nproc, "strategies": strategies, "steps": steps, "batch_size": batch_size,
            "repeats": repeats, "parameter_server": parameter_server, "in_process": in_process,
            "tf_python": tf_python, "tf_inter_op": tf_inter_op, "progress": progress}
    _run_and_emit(ctx, "train", opts, always={"nproc"}, soft={"in_process"})


@bench.command("train-ps")
@nproc_option("Processes to launch: the chief, --num-ps parameter servers and the rest workers.", 3, 4)
@count_option("--num-ps", "num_ps", "Parameter servers (default 1).")
@count_option("--steps", "steps", "Scheduled steps timed per round.")
@count_option("--batch-size", "batch_size", "Batch per step (default 64).")
@repeats_option("Rounds; the median over them is reported (default 3).")
@output_options
@click.pass_context
def train_ps(ctx: click.Context, nproc, num_ps, steps, batch_size, repeats, progress, **_) -> None:
    """ParameterServerStrategy's training throughput (steps/s, bytes pulled/pushed per step) beside the same
    steps in one process (launches torchrun: chief, ps, workers)."""
    opts = {"nproc": nproc, "num_ps": num_ps, "steps": steps, "batch_size": batch_size, "repeats": repeats,
            "progress": progress}
    _run_and_emit(ctx, "train-ps", opts, always={"nproc"})


@bench.command()
@count_option("--steps", "steps", "Timed steps (the compile rows: a tenth).")
@repeats_option("Interleaved rounds; the median over them is reported (default 3).")
@click.option(
    "--group",
    "groups",
    type=click.Choice(["overhead", "compile"]),
    multiple=True,
    help="Only these row groups (repeat). Default: both.",
)
@count_option("--threads", "threads", "torch intra-op threads (default: torch's).")
@_tf_options
@output_options
@click.pass_context
def inproc(ctx: click.Context, steps, repeats, groups, threads, tf_python, tf_inter_op, progress, **_) -> None:
    """The in-process rows of bench train alone: strategy overhead per replica (MLP 64-64-10) and
    MirroredStrategy(2) eager vs torch.compile (MLP 784-1024-1024-10), in this process."""
    opts = {"steps": steps, "repeats": repeats, "groups": groups, "threads": threads, "tf_python": tf_python,
            "tf_inter_op": tf_inter_op, "progress": progress}
    _run_and_emit(ctx, "inproc", opts)
