"""Helpers shared by the CLI commands' implementations: lazy loading of bench modules, calling a bench's
``run`` with the options it takes, and the one report path of every benchmark (:func:`emit_result`). The
parser (options, sizes, help) is ``torchstrategies_cli``, which imports no torch.

The benchmarks live in ``torchstrategies.bench.<name>`` and land branch by branch, so every command
imports its module only when it runs, and a missing module is a one-line error
(``not available in this build: torchstrategies.bench.train``), never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console

    from torchstrategies.bench.report import BenchResult

__all__ = [
    "NotAvailable",
    "load_module",
    "module_available",
    "call_with_supported",
    "emit_result",
]

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
