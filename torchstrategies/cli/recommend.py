"""From benchmark tables to advice: which implementation wins at which size.

A BenchResult from ``bench kernels`` or ``bench allreduce`` has one row per (implementation, size[, N]).
:func:`detect_roles` finds which column plays which role:

* ``impl``: the implementation / kernel name;
* ``size``: the message or tensor size (numbers, or strings such as ``"4 KiB"`` / ``"16M"``);
* ``time``: a time to minimize (``median ms``...), or else ``score``: a rate to maximize (``GB/s``);
* ``group`` (optional): a further key such as N, the number of tensors summed.

A bench module can state them in ``result.meta["roles"] = {"impl": "kernel", "size": "elements",
"time": "median (ms)", "group": "N"}``; otherwise they are guessed from the column names. Rows whose
implementation is a reference, not a candidate (``meta["baselines"]``, a name with "roofline", or one
that starts with "copy" / "memcpy"), are left out of the race.

Example:
    >>> from torchstrategies.bench.report import BenchResult
    >>> r = BenchResult("t", ["impl", "size", "median (ms)"], [
    ...     {"impl": "a", "size": 1024, "median (ms)": 1.0}, {"impl": "b", "size": 1024, "median (ms)": 2.0},
    ...     {"impl": "a", "size": 4096, "median (ms)": 9.0}, {"impl": "b", "size": 4096, "median (ms)": 3.0}])
    >>> [(w.size_label, w.best) for w in winners(r)]
    [('1024', 'a'), ('4096', 'b')]
    >>> size_ranges(winners(r))
    [('1024', '1024', 'a'), ('4096', '4096', 'b')]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchstrategies_cli._options import SIZE_UNITS

if TYPE_CHECKING:
    from torchstrategies.bench.report import BenchResult

__all__ = ["Roles", "Winner", "detect_roles", "winners", "size_ranges", "parse_number", "series"]

_IMPL_NAMES = (
    "implementation",
    "impl",
    "kernel",
    "method",
    "algorithm",
    "algo",
    "op",
    "name",
    "variant",
    "strategy",
)
_SIZE_WORDS = ("size", "bytes", "numel", "elements", "message", "msg")
_TIME_WORDS = ("median", "time", "latency", "(ms)", "(us)", "(µs)", "(s)", " ms", " us", "_ms", "_us")
_SCORE_WORDS = ("gb/s", "gbps", "algbw", "busbw", "samples/s", "throughput", "steps/s")
_GROUP_NAMES = ("n", "ranks", "world", "world_size", "nproc", "tensors", "num_tensors", "dtype")
_BASELINE_RE = re.compile(
    r"roofline|^\s*(copy|memcpy)\b", re.IGNORECASE
)  # "copy (roofline)", not "shm-zero-copy"
_UNIT_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUM_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Zµ]*)\s*[x×]?\s*$")


@dataclass(frozen=True)
class Roles:
    """Which column of a BenchResult plays which role (see the module docstring)."""

    impl: str
    size: str
    metric: str
    minimize: bool
    group: str | None = None


@dataclass(frozen=True)
class Winner:
    """The best implementation at one (group, size) point."""

    group: object
    size: float | None
    size_label: str
    best: str
    best_value: float
    runner_up: str | None
    runner_up_value: float | None

    @property
    def margin(self) -> float | None:
        """How much better the winner is than the runner-up (a ratio >= 1)."""
        if self.runner_up_value is None or self.best_value <= 0 or self.runner_up_value <= 0:
            return None
        r = self.runner_up_value / self.best_value
        return r if r >= 1 else 1 / r


def parse_number(value: object, *, kind: str = "plain") -> float | None:
    """A float from a cell: numbers as they are; ``"1.5 ms"`` in seconds (kind="time"); ``"4 KiB"`` in
    units (kind="size"); None if it is not a number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(float(value)) else None
    m = _NUM_RE.match(str(value))
    if not m:
        return None
    x, unit = float(m.group(1)), m.group(2)
    if unit.lower() == "x":  # a ratio such as "1.25x"
        unit = ""
    if kind == "time" and unit:
        factor = _UNIT_SECONDS.get(unit.lower() if unit != "µs" else unit)
        return None if factor is None else x * factor
    if kind == "size":
        factor = SIZE_UNITS.get(unit.lower())
        return None if factor is None else x * factor
    return x if not unit else None


def _find(columns: list[str], exact: tuple[str, ...], words: tuple[str, ...], taken: set[str]) -> str | None:
    low = {c: c.lower().strip() for c in columns if c not in taken}
    for name in exact:
        for c, lc in low.items():
            if lc == name:
                return c
    for c, lc in low.items():
        if any(w in lc for w in words):
            return c
    return None


def detect_roles(result: BenchResult) -> Roles:
    """The roles of ``result``'s columns: ``meta["roles"]`` if given, else guessed from the column names.

    Raises:
        ValueError: a role cannot be found; the message lists the columns and how to declare the roles.
    """
    cols = list(result.columns)
    declared = dict((result.meta or {}).get("roles", {}))
    taken: set[str] = set()
    impl = declared.get("impl") or _find(cols, _IMPL_NAMES, ("impl", "kernel", "method", "algorithm"), taken)
    if impl:
        taken.add(impl)
    size = declared.get("size") or _find(cols, (), _SIZE_WORDS, taken)
    if size:
        taken.add(size)
    group = declared.get("group") or _find(cols, _GROUP_NAMES, (), taken)
    if group:
        taken.add(group)
    metric, minimize = declared.get("time"), True
    if not metric and declared.get("score"):
        metric, minimize = declared["score"], False
    if not metric:
        metric = _find(cols, (), ("median",), taken) or _find(cols, (), _TIME_WORDS, taken)
    if not metric:
        metric, minimize = _find(cols, (), _SCORE_WORDS, taken), False
    missing = [r for r, c in (("impl", impl), ("size", size), ("time or score", metric)) if not c]
    if missing:
        raise ValueError(
            f"cannot tell the {', '.join(missing)} column of {result.title!r} (columns: {cols}); the bench "
            "module can declare them: result.meta['roles'] = {'impl': ..., 'size': ..., 'time': ...}"
        )
    for role, c in (("impl", impl), ("size", size), ("metric", metric), ("group", group)):
        if c is not None and c not in cols:
            raise ValueError(f"meta['roles'] names {role} column {c!r}, which is not in {cols}")
    return Roles(impl=impl, size=size, metric=metric, minimize=minimize, group=group)  # type: ignore[arg-type]


def _is_baseline(name: str, result: BenchResult) -> bool:
    baselines = set((result.meta or {}).get("baselines", []))
    return name in baselines or bool(_BASELINE_RE.search(name))


def series(result: BenchResult, roles: Roles | None = None) -> dict[object, dict[str, list[tuple[float, float]]]]:
    """``{group: {impl: [(size, value), ...]}}`` sorted by size, for plots (unparsable rows are skipped)."""
    roles = roles or detect_roles(result)
    out: dict[object, dict[str, list[tuple[float, float]]]] = {}
    for row in result.rows:
        size = parse_number(row.get(roles.size), kind="size")
        value = parse_number(row.get(roles.metric), kind="time" if roles.minimize else "plain")
        if size is None or value is None:
            continue
        g = row.get(roles.group) if roles.group else None
        out.setdefault(g, {}).setdefault(str(row.get(roles.impl)), []).append((size, value))
    for impls in out.values():
        for pts in impls.values():
            pts.sort()
    return out


def winners(result: BenchResult, roles: Roles | None = None) -> list[Winner]:
    """The fastest candidate at every (group, size) point of ``result``, sorted by group then size."""
    roles = roles or detect_roles(result)
    points: dict[tuple[object, str], list[tuple[float, str]]] = {}
    sizes: dict[tuple[object, str], float | None] = {}
    for row in result.rows:
        impl = str(row.get(roles.impl))
        if _is_baseline(impl, result):
            continue
        value = parse_number(row.get(roles.metric), kind="time" if roles.minimize else "plain")
        if value is None:
            continue
        g = row.get(roles.group) if roles.group else None
        label = str(row.get(roles.size))
        key = (g, label)
        points.setdefault(key, []).append((value, impl))
        sizes[key] = parse_number(row.get(roles.size), kind="size")
    out = []
    for (g, label), entries in points.items():
        entries.sort(key=lambda e: e[0], reverse=not roles.minimize)
        best_v, best = entries[0]
        ru = entries[1] if len(entries) > 1 else (None, None)
        out.append(Winner(g, sizes[(g, label)], label, best, best_v, ru[1], ru[0]))

    def order(w: Winner) -> tuple:
        g = parse_number(w.group)
        return (
            g if g is not None else math.inf,
            str(w.group),
            w.size if w.size is not None else math.inf,
            w.size_label,
        )

    return sorted(out, key=order)


def size_ranges(ws: list[Winner]) -> list[tuple[str, str, str]]:
    """Consecutive sizes with the same winner merged: ``[(from_label, to_label, impl), ...]`` (one group)."""
    out: list[list[str]] = []
    for w in ws:
        if out and out[-1][2] == w.best:
            out[-1][1] = w.size_label
        else:
            out.append([w.size_label, w.size_label, w.best])
    return [tuple(x) for x in out]  # type: ignore[misc]
