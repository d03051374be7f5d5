"""The ``torchstrategies`` console script (also ``python -m torchstrategies``): the parser, without torch.

Built on click (subcommands, options, help text) with rich for tables and progress bars::

    torchstrategies env                       # what this machine has (paste it in bug reports)
    torchstrategies bench kernels --plot k.png
    torchstrategies bench allreduce --nproc 2 --json ar.json
    torchstrategies bench train --nproc 2
    torchstrategies compare                   # which kernel / all-reduce to use for which size
    torchstrategies demo [--fast]             # what `make demo` runs

This package declares every command's options and help and imports neither torch nor ``torchstrategies``
(whose import loads torch and registers the c10d backend), so ``--help`` starts at once. Each command is an
:class:`~torchstrategies_cli._command.ImplCommand`: its body is a function of ``torchstrategies.cli``,
imported when the command runs and called with every option the parser declares. A command whose bench
module is not in this build stops with ``Error: not available in this build: <module>`` (exit status 1).
"""

from __future__ import annotations

import click

from torchstrategies_cli._command import ImplCommand
from torchstrategies_cli._options import count_option, nproc_option, repeats_option, sizes_option
from torchstrategies_cli.bench import bench

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torchstrategies", prog_name="torchstrategies")
def main() -> None:
    """torchstrategies: tf.distribute strategies for PyTorch."""


main.add_command(bench)


@main.command(cls=ImplCommand, target="torchstrategies.cli.compare:compare")
@nproc_option("Ranks for the all-reduce run.", minimum=2)
@count_option("--n", "n", "Tensors summed by the kernels (repeat).", multiple=True)
@sizes_option("--kernel-size", "kernel_sizes", "Elements per tensor for the kernels (repeat), e.g. 64K, 16M.")
@sizes_option("--message-size", "message_sizes", "All-reduce message size in bytes (repeat), e.g. 4KiB, 64MiB.")
@repeats_option()
@click.option(
    "--kernels-from",
    type=click.Path(exists=True, dir_okay=False),
    help="Use this `bench kernels --json` file instead of running the kernels.",
)
@click.option(
    "--allreduce-from",
    type=click.Path(exists=True, dir_okay=False),
    help="Use this `bench allreduce --json` file instead of running the all-reduce benchmark.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Write advice and raw results as JSON."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default="torchstrategies-compare.png",
    show_default=True,
    help="Where to draw the chart.",
)
@click.option("--no-plot", is_flag=True, help="Do not draw the chart.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def compare() -> None:
    """Run every aggregation kernel and all-reduce implementation; print which to use for which size."""


@main.command(cls=ImplCommand, target="torchstrategies.cli.env_cmd:env")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Write the same information as JSON ('-' for stdout, instead of the table).",
)
def env() -> None:
    """Print torch/CUDA/NCCL/gloo versions, cores, the built kernels and hosts (paste it in bug reports)."""


@main.command(cls=ImplCommand, target="torchstrategies.cli.demo:demo")
@click.option("--fast", is_flag=True, help="A few seconds per example and tiny benchmark sizes (for tests).")
@click.option(
    "--out",
    "out_dir",
    default="demo-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where the summary JSON, the kernel results and the PNG plot go.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=None,
    help="Seconds allowed per example (default 180 with --fast, 900 without).",
)
def demo() -> None:
    """The main job: train digits with each strategy, then compare the aggregation kernels."""
