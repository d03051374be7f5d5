"""Helpers shared by the CLI commands: lazy loading of bench modules, size parsing, the shared options and
the one report path of every benchmark (:func:`emit_result`).

The benchmarks live in ``torchstrategies.bench.<name>`` and land branch by branch, so every command
imports its module only when it runs, and a missing module is a one-line error
(``not available in this build: torchstrategies.bench.train``), never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from rich.console import Console

    from torchstrategies.bench.report import BenchResult

__all__ = [
    "ApiCommand",
    "ApiGroup",
    "NotAvailable",
    "load_module",
    "module_available",
    "call_with_supported",
    "parse_size",
    "SizeType",
    "SIZE_UNITS",
    "emit_result",
    "nproc_option",
    "sizes_option",
    "repeats_option",
    "count_option",
    "output_options",
]

# Binary size suffixes (lower case) -> bytes or elements; recommend.py reads table cells with the same units.
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


class ApiCommand(click.Command):
    """A command that runs with the package's public API (and torch) loaded: ``torchstrategies --help``,
    ``... bench kernels --help`` and usage errors exit while the arguments are parsed, before this, so they
    never import torch (``torchstrategies._startup``)."""

    def invoke(self, ctx: click.Context) -> Any:
        import torchstrategies

        torchstrategies.load_api()
        return super().invoke(ctx)


class ApiGroup(click.Group):
    """A group whose commands (and subgroups' commands) are :class:`ApiCommand`."""

    command_class = ApiCommand
    group_class = type  # a subgroup is an ApiGroup too


class NotAvailable(click.ClickException):
    """A command's backing module is not part of this build (it lands with another branch)."""

    def __init__(self, what: str, why: str = "") -> None:
        super().__init__(f"not available in this build: {what}" + (f" ({why})" if why else ""))


def module_available(name: str) -> bool:
    """True if ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load_module(name: str) -> ModuleType:
    """Imports ``name`` or raises :class:`NotAvailable`; a module that exists but fails to import says why."""
    if not module_available(name):
        raise NotAvailable(name)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise click.ClickException(f"{name} is in this build but failed to import: {exc}") from exc


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


def call_with_supported(
    fn: Callable[..., Any],
    what: str,
    options: Sequence[tuple[str, tuple[str, ...], Any, bool | None]],
) -> Any:
    """Calls ``fn`` with the options its signature accepts.

    Each option is ``(cli_name, parameter_aliases, value, explicit)``. The first alias ``fn`` accepts gets
    the value (all of them go under the first alias if ``fn`` takes ``**kwargs``). An option the user set
    explicitly that ``fn`` cannot take is a usage error naming the option and ``fn``'s signature; one left
    at its default (``explicit`` False) is dropped, so each bench module keeps its own defaults; one with
    ``explicit`` None is passed when ``fn`` accepts it and dropped otherwise (e.g. ``progress``).

    Raises:
        click.UsageError: an explicit option that ``fn`` does not accept.
    """
    sig = inspect.signature(fn)
    params = sig.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    for cli_name, aliases, value, explicit in options:
        if explicit is False:
            continue
        target = next((a for a in aliases if a in params), None)
        if target is None and takes_kwargs:
            target = aliases[0]
        if target is None:
            if explicit is None:
                continue
            raise click.UsageError(f"{cli_name} is not supported by {what}{sig}")
        kwargs[target] = _adapt(value, target)
    return fn(**kwargs)


def _adapt(value: object, target: str) -> object:
    """Tuples from ``multiple=True`` options become lists; a singular parameter gets the single value."""
    if isinstance(value, tuple):
        if not target.endswith("s") and len(value) == 1:
            return value[0]
        return list(value)
    return value


def emit_result(
    result: BenchResult,
    module: ModuleType,
    json_path: str | None = None,
    plot_path: str | None = None,
    markdown: bool = False,
    console: Console | None = None,
) -> None:
    """Every benchmark's one report path: prints ``result``'s table (and its Markdown with ``markdown``),
    then writes ``--json`` and draws ``--plot`` with the module's ``plot(result, path)`` if asked.

    Raises:
        NotAvailable: ``plot_path`` is given and ``module`` has no ``plot``.
    """
    result.print(console)
    if markdown:
        click.echo(result.markdown())
    if json_path:
        _ensure_parent(json_path)
        result.write_json(json_path)
        click.echo(f"results written to {json_path}")
    if plot_path:
        plot = getattr(module, "plot", None)
        if plot is None:
            raise NotAvailable(f"{module.__name__}.plot")
        _ensure_parent(plot_path)
        plot(result, plot_path)
        click.echo(f"plot written to {plot_path}")


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


# ---- options several commands share (bench kernels / allreduce / train / train-ps, compare)

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
    """``--plot``, ``--json``, ``--markdown`` and ``--progress/--no-progress``: what :func:`emit_result` and
    the progress bar need."""
    fn = click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a chart (PNG).")(fn)
    fn = click.option(
        "--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON."
    )(fn)
    fn = click.option("--markdown", is_flag=True, help="Also print the table as Markdown (for docs).")(fn)
    fn = click.option(
        "--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr."
    )(fn)
    return fn
