"""What the parser needs and no command implementation does: sizes (``64K``, ``4KiB``), their click type and
the options several commands share. Imports click only (this package never imports torch)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = [
    "SIZE_UNITS",
    "parse_size",
    "SizeType",
    "nproc_option",
    "sizes_option",
    "repeats_option",
    "count_option",
    "output_options",
]

# Binary size suffixes (lower case) -> bytes or elements; torchstrategies.cli.recommend reads table cells with
# the same units.
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: object) -> int:
    """``"64K"`` -> 65536, ``"4 KiB"`` -> 4096, ``"1M"`` -> 1048576, ``"100"`` -> 100 (binary units).

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 4KiB, 16M, 1GiB)")
    value = float(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"not a whole size: {text!r}")
    return int(value)


class SizeType(click.ParamType):
    """A click parameter for sizes such as 64K, 4KiB, 16M."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


F = TypeVar("F", bound=Callable[..., Any])


def nproc_option(help: str, minimum: int = 1, default: int = 2) -> Callable[[F], F]:
    """``--nproc N``: the ranks a command launches."""
    return click.option("--nproc", type=click.IntRange(minimum), default=default, show_default=True, help=help)


def sizes_option(flag: str, dest: str, help: str) -> Callable[[F], F]:
    """A repeatable size option (``--size 64K --size 16M``) into the parameter ``dest``."""
    return click.option(flag, dest, type=SizeType(), multiple=True, help=help)


def repeats_option(help: str = "Timed repetitions per point.") -> Callable[[F], F]:
    """``--repeats K``; left at None so the bench module's own default applies."""
    return count_option("--repeats", "repeats", help)


def count_option(flag: str, dest: str, help: str, multiple: bool = False) -> Callable[[F], F]:
    """A whole number >= 1 into ``dest`` (repeatable with ``multiple``); unset, it stays None (or ``()``) so
    the bench module's own default applies."""
    return click.option(flag, dest, type=click.IntRange(1), multiple=multiple, default=None, help=help)


def output_options(fn: F) -> F:
    """``--plot``, ``--json``, ``--markdown`` and ``--progress/--no-progress``: what
    ``torchstrategies.cli._common.emit_result`` and the progress bar need."""
    fn = click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a chart (PNG).")(fn)
    fn = click.option(
        "--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON."
    )(fn)
    fn = click.option("--markdown", is_flag=True, help="Also print the table as Markdown (for docs).")(fn)
    fn = click.option(
        "--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr."
    )(fn)
    return fn
