"""One result type for every benchmark, printed as an aligned table (rich) and saved as JSON.

Example:
    >>> from torchstrategies.bench.report import BenchResult
    >>> r = BenchResult("demo", columns=["n", "ms"], rows=[{"n": 2, "ms": 1.5}])
    >>> r.to_dict()["rows"][0]["ms"]
    1.5
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["BenchResult", "median", "progress", "bar_chart", "print_table", "machine", "stamp"]

T = TypeVar("T")


@dataclass
class BenchResult:
    """A benchmark's table: ``rows`` are dicts keyed by ``columns``; ``notes`` print under the table.
    ``meta["formats"]`` may give a column its own format spec (``{"accuracy": ".4f"}``); other floats show
    2 decimals (3 significant digits when very small or large)."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BenchResult:
        return BenchResult(d["title"], list(d["columns"]), list(d["rows"]), list(d.get("notes", [])),
                           dict(d.get("meta", {})))

    @staticmethod
    def read_json(path: str) -> BenchResult:
        """Reads a file written by :meth:`write_json` (or ``torchstrategies bench ... --json``).

        Raises:
            ValueError: the file is not a BenchResult's JSON (the message names the file and what is missing).
        """
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not JSON: {exc}") from None
        missing = [k for k in ("title", "columns", "rows") if not isinstance(d, dict) or k not in d]
        if missing:
            raise ValueError(f"{path} is not a benchmark result: it lacks {missing}")
        return BenchResult.from_dict(d)

    def print(self, console: Console | None = None) -> None:
        """Prints the table with rich (aligned columns, numbers right-justified)."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = console or Console()
        table = Table(title=Text(self.title))
        for c in self.columns:  # numbers right-aligned, text left-aligned
            numeric = all(isinstance(r.get(c, ""), (int, float)) or r.get(c, "") == "" for r in self.rows)
            table.add_column(Text(c), justify="right" if numeric else "left", overflow="fold")  # never "…"
        for row in self.rows:  # Text(): brackets in cells and notes are text, not rich markup
            table.add_row(*(Text(self._cell(row, c)) for c in self.columns))
        print_table(table, console)
        for note in self.notes:
            console.print(Text(str(note)), soft_wrap=not console.is_terminal)

    def markdown(self) -> str:
        """The table as GitHub Markdown, for the README and docs."""
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        for row in self.rows:
            lines.append("| " + " | ".join(self._cell(row, c) for c in self.columns) + " |")
        return "\n".join(lines)

    def _cell(self, row: dict[str, Any], column: str) -> str:
        value, spec = row.get(column, ""), self.meta.get("formats", {}).get(column)
        return format(value, spec) if spec and isinstance(value, (int, float)) else _fmt(value)


def print_table(table: Table, console: Console | None = None) -> None:
    """Prints a rich table: fitted to the terminal's width on a terminal; otherwise (a file, a pipe, ``| tee``)
    in a plain layout, columns separated by spaces and every row on one line, however wide, since there is no
    terminal width to fit (``--markdown`` prints the Markdown table as well)."""
    from rich.console import Console

    console = console or Console()
    if console.is_terminal:
        console.print(table)
        return
    table.box = None
    table.pad_edge = False
    table.collapse_padding = True
    narrow = console.width
    console.width = 1 << 16
    try:
        console.width = max(narrow, console.measure(table).maximum)
        console.print(table)
    finally:
        console.width = narrow


def machine() -> str:
    """This machine in a few words, for a figure's record: CPU model and logical CPUs."""
    from torchstrategies.env_info import cpu_model

    return f"{cpu_model() or platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def stamp(result: BenchResult, command: str, started: datetime.datetime, load_before: float) -> None:
    """Records how ``result`` was made, in ``meta["recorded"]`` and in its title (which its plot shows): the
    command, the UTC date it started, the machine and the 1-minute load at the start and now, the end."""
    load_after = os.getloadavg()[0]
    record = {"command": command, "date_utc": started.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "machine": machine(), "load_1min_start": round(load_before, 2), "load_1min_end": round(load_after, 2)}
    result.meta["recorded"] = record
    result.title += (f"\nrecorded {record['date_utc']} UTC on {record['machine']}, 1-min load "
                     f"{load_before:.1f} -> {load_after:.1f}")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e5:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def progress(
    items: Iterable[T], description: str, total: int | None = None, enabled: bool = True
) -> Iterator[T]:
    """Iterates ``items`` with a rich progress bar on stderr (plain iteration when disabled)."""
    if not enabled:
        yield from items
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total if total is not None else len(items))  # type: ignore[arg-type]
        for item in items:
            yield item
            bar.advance(task)


def bar_chart(result: BenchResult, path: str, metric: str, references: tuple[str, ...] = ()) -> None:
    """One horizontal bar per row of ``result``: ``metric`` by ``runner``, the ``references`` in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["runner"] for r in result.rows]
    values = [r[metric] for r in result.rows]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.35 * len(names)))
    ax.barh(names, values, color=["#888" if n in references else "#3a7" for n in names])
    ax.set_xlabel(f"{metric} (higher is better)")
    ax.set_title(result.title, fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
