"""The ``torchstrategies`` console script (also ``python -m torchstrategies``).

Built on click (subcommands, options, help text) with rich for tables and progress bars::

    torchstrategies env                       # what this machine has (paste it in bug reports)
    torchstrategies bench kernels --plot k.png
    torchstrategies bench allreduce --nproc 2 --json ar.json
    torchstrategies bench train --nproc 2
    torchstrategies compare                   # which kernel / all-reduce to use for which size
    torchstrategies demo [--fast]             # what `make demo` runs

Every command imports what it needs when it runs; a command whose module is not in this build stops with
``Error: not available in this build: <module>`` (exit status 1).
"""

from __future__ import annotations

import click

from torchstrategies import __version__
from torchstrategies.cli.bench_cmds import bench
from torchstrategies.cli.compare import compare
from torchstrategies.cli.env_cmd import env

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="torchstrategies")
def main() -> None:
    """torchstrategies: tf.distribute strategies for PyTorch."""


main.add_command(bench)
main.add_command(compare)
main.add_command(env)


@main.command("demo")
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
def demo_command(fast: bool, out_dir: str, timeout: float | None) -> None:
    """The main job: train digits with each strategy, then compare the aggregation kernels."""
    import importlib

    # (Not `from torchstrategies.cli import demo`: the name must stay the module, not this command.)
    demo_mod = importlib.import_module("torchstrategies.cli.demo")

    code = demo_mod.run(fast=fast, out_dir=out_dir, timeout=timeout)
    if code:
        raise SystemExit(code)
