"""The one seam between the parser and the commands: :class:`ImplCommand`, a click command whose options and
help are declared in this package and whose body is a function elsewhere, imported only when it runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import click

__all__ = ["ImplCommand"]


class ImplCommand(click.Command):
    """A command run by ``target`` (``"module:function"``), called as ``function(ctx, **params)`` with every
    parameter the parser declares; the decorated stub only gives the help text (its docstring).

    Example:
        >>> @click.command(cls=ImplCommand, target="torchstrategies.cli.env_cmd:env")
        ... @click.option("--json", "json_path")
        ... def env() -> None:
        ...     '''Print what this machine has.'''
        >>> env.target
        'torchstrategies.cli.env_cmd:env'
    """

    def __init__(self, name: str | None, *, target: str, **kwargs: Any) -> None:
        kwargs["callback"] = self._run
        super().__init__(name, **kwargs)
        self.target = target

    def implementation(self) -> Callable[..., Any]:
        """Imports and returns the function that runs this command."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]

    def _run(self, **params: Any) -> Any:
        return self.implementation()(click.get_current_context(), **params)
