"""The first build's output, for people (setup.py uses it): one line saying the C++ extension is compiling
and about how long it takes, the compiler's commands and messages kept in a log, shown only if the build
fails. ``TORCHSTRATEGIES_BUILD_VERBOSE=1`` shows everything as it comes. Torch-free (tests import it).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence

__all__ = ["quiet_build", "estimate_minutes", "out_of_date"]

# CPU seconds one of our translation units takes with -O3 (they include torch's headers), a rough figure.
SECONDS_PER_SOURCE = 40.0


def estimate_minutes(n_sources: int, jobs: int) -> int:
    """About how many minutes ``n_sources`` files take on ``jobs`` parallel compilers (at least 1)."""
    return max(1, math.ceil(n_sources * SECONDS_PER_SOURCE / max(1, jobs) / 60))


def out_of_date(target: str, inputs: Sequence[str]) -> bool:
    """True if ``target`` is missing or older than one of ``inputs`` (what ninja would rebuild)."""
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(p) > built for p in inputs if os.path.exists(p))


@contextlib.contextmanager
def quiet_build(message: str, log_path: str, verbose: bool | None = None, tail: int = 60) -> Iterator[None]:
    """Says ``message`` once, then sends everything written to this process's stdout and stderr (the
    compiler's commands and messages, from child processes too) to ``log_path`` until the block ends. If the
    block raises, the end of the log is shown on stderr, with the log's path, before the error goes on.

    ``verbose`` (default: ``TORCHSTRATEGIES_BUILD_VERBOSE=1``): no redirection, everything shows as it comes.
    """
    if verbose is None:
        verbose = os.environ.get("TORCHSTRATEGIES_BUILD_VERBOSE") == "1"
    print(message if verbose else f"{message}; the compiler's output goes to {log_path}", flush=True)
    if verbose:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    except BaseException:
        with open(log_path, errors="replace") as log:
            lines = log.read().splitlines()
        shown = "\n".join(lines[-tail:])
        print(f"the build failed; the last {min(tail, len(lines))} lines of {log_path}:\n{shown}", file=sys.stderr,
              flush=True)
        raise
    finally:
        os.close(saved[0])
        os.close(saved[1])
