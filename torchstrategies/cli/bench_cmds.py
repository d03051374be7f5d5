"""``torchstrategies bench kernels | allreduce | train | train-ps | inproc | ft-recovery | agreement``: the one
way to run a benchmark. Their options and help are declared in ``torchstrategies_cli.bench`` (no torch); the functions
here run them, called with every option the parser declares.

Each imports ``torchstrategies.bench.<name>`` when it runs, calls its ``run(...)`` with the
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

from torchstrategies.cli._common import NotAvailable, call_with_supported, emit_result, load_module

if TYPE_CHECKING:
    from torchstrategies.bench.report import BenchResult

__all__ = ["run_bench", "kernels", "allreduce", "train", "train_ps", "inproc", "ft_recovery", "agreement"]

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
    "ft-recovery": "torchstrategies.bench.fault_tolerance",
    "agreement": "torchstrategies.bench.agreement_cost",
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
    report: tuple[str | None, str | None, bool],
    *,
    always: AbstractSet[str] = frozenset(),
    soft: AbstractSet[str] = frozenset(),
) -> None:
    """Runs bench ``name`` with the command's options (those the user set, plus ``always``) and reports it
    through ``emit_result`` with ``report`` = the command's ``(--json, --plot, --markdown)``."""
    from click.core import ParameterSource

    explicit = {k for k in options if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)}
    result, module = run_bench(name, options, explicit | always, soft=soft)
    json_path, plot_path, markdown = report
    emit_result(result, module, json_path, plot_path, markdown)


def kernels(ctx: click.Context, n, kernel_sizes, repeats, threads, progress, markdown, json_path, plot_path
            ) -> None:
    """``bench kernels``."""
    opts = {"n": n, "kernel_sizes": kernel_sizes, "repeats": repeats, "threads": threads, "progress": progress}
    _run_and_emit(ctx, "kernels", opts, (json_path, plot_path, markdown))


def allreduce(ctx: click.Context, nproc, message_sizes, impls, repeats, simulate_hosts, hosts, link, delay_ms,
              progress, markdown, json_path, plot_path) -> None:
    """``bench allreduce``; ``--hosts N`` without ``--nproc`` runs one rank per host.

    Raises:
        click.UsageError: ``--link`` or ``--delay-ms`` without ``--hosts``.
    """
    from click.core import ParameterSource

    if (link is not None or delay_ms is not None) and not hosts:
        raise click.UsageError("--link and --delay-ms need --hosts N")
    if hosts and ctx.get_parameter_source("nproc") is ParameterSource.DEFAULT:
        nproc = hosts  # one rank per host unless --nproc says otherwise
    opts = {"nproc": nproc, "message_sizes": message_sizes, "impls": impls, "repeats": repeats,
            "simulate_hosts": simulate_hosts, "hosts": hosts, "link": link, "delay_ms": delay_ms,
            "progress": progress}
    _run_and_emit(ctx, "allreduce", opts, (json_path, plot_path, markdown), always={"nproc"})


def train(ctx: click.Context, nproc, strategies, steps, batch_size, repeats, parameter_server, in_process,
          tf_python, tf_inter_op, hosts, link, progress, markdown, json_path, plot_path) -> None:
    """``bench train``.

    Raises:
        click.UsageError: ``--link`` without ``--hosts``.
    """
    if link is not None and not hosts:
        raise click.UsageError("--link needs --hosts N")
    opts = {"nproc": nproc, "strategies": strategies, "steps": steps, "batch_size": batch_size,
            "repeats": repeats, "parameter_server": parameter_server, "in_process": in_process,
            "tf_python": tf_python, "tf_inter_op": tf_inter_op, "hosts": hosts, "link": link, "progress": progress}
    _run_and_emit(ctx, "train", opts, (json_path, plot_path, markdown), always={"nproc"}, soft={"in_process"})


def train_ps(ctx: click.Context, nproc, num_ps, steps, batch_size, repeats, progress, markdown, json_path,
             plot_path) -> None:
    """``bench train-ps``."""
    opts = {"nproc": nproc, "num_ps": num_ps, "steps": steps, "batch_size": batch_size, "repeats": repeats,
            "progress": progress}
    _run_and_emit(ctx, "train-ps", opts, (json_path, plot_path, markdown), always={"nproc"})


def inproc(ctx: click.Context, steps, repeats, groups, threads, tf_python, tf_inter_op, progress, markdown,
           json_path, plot_path) -> None:
    """``bench inproc``."""
    opts = {"steps": steps, "repeats": repeats, "groups": groups, "threads": threads, "tf_python": tf_python,
            "tf_inter_op": tf_inter_op, "progress": progress}
    _run_and_emit(ctx, "inproc", opts, (json_path, plot_path, markdown))


def ft_recovery(ctx: click.Context, nproc, steps, kill_at, checkpoint_every, batch_size, progress, markdown,
                json_path, plot_path) -> None:
    """``bench ft-recovery``."""
    opts = {"nproc": nproc, "steps": steps, "kill_at": kill_at, "checkpoint_every": checkpoint_every,
            "batch_size": batch_size, "progress": progress}
    _run_and_emit(ctx, "ft-recovery", opts, (json_path, plot_path, markdown), always={"nproc"})


def agreement(ctx: click.Context, nproc, blocks, steps, batch_size, progress, markdown, json_path, plot_path
              ) -> None:
    """``bench agreement``."""
    opts = {"nproc": nproc, "blocks": blocks, "steps": steps, "batch_size": batch_size, "progress": progress}
    _run_and_emit(ctx, "agreement", opts, (json_path, plot_path, markdown), always={"nproc"})
