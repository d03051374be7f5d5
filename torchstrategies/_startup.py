"""Is this process the command line starting? (torch-free: ``torchstrategies --help`` imports no torch)

``torchstrategies ...`` (the console script) and ``python -m torchstrategies ...`` import this package before
the command line runs. While they start, ``import torchstrategies`` leaves the public API (and torch) for
later: the command that runs loads it (``cli._common.ApiCommand``), and so does the first public name asked
for; ``--help`` and a usage error never need it. Every other process (a script, a test, a torchrun or
multiprocessing worker, even one whose ``sys.argv`` was copied from the command line) imports it all at once.
The answer comes from ``sys.orig_argv``, the command line the interpreter itself was given.
"""

from __future__ import annotations

import os
import sys

__all__ = ["cli_is_starting"]

_TAKES_VALUE = ("-W", "-X", "--check-hash-based-pycs")  # interpreter options whose value is the next word


def cli_is_starting(orig_argv: list[str] | None = None) -> bool:
    """True when the interpreter was started as ``torchstrategies ...`` or ``python -m torchstrategies ...``."""
    args = list(sys.orig_argv if orig_argv is None else orig_argv)[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            return args[i + 1 : i + 2] == ["torchstrategies"]
        if arg.startswith("-m"):
            return arg[2:] == "torchstrategies"
        if arg == "-" or arg.startswith("-c"):
            return False
        if arg in _TAKES_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return os.path.basename(arg) == "torchstrategies"  # the script: the console script is named so
    return False
