"""docs/architecture.md's table of the folders beside the layers says which layers each one imports; the
code agrees (issue 39: the table used to claim "using none of them" for folders that import them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "torchstrategies"
LAYERS = ("_ext", "ops", "collectives", "distribute", "strategies", "parameter_server", "bench")


def _table() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("Beside them"):text.index("## The parameter server's layers")]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("folder / file", "---"):
            continue
        uses = {u for u in re.findall(r"`([a-z_]+)`", cells[2]) if u in LAYERS}
        for name in re.findall(r"`([a-z_/.]+)`", cells[0]):
            rows[name] = uses
    return rows


def _imports(name: str) -> set[str]:
    files = sorted((PKG / name).glob("*.py")) if name.endswith("/") else [PKG / name]
    used: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            mods: list[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for m in mods:
                parts = m.split(".")
                if parts[0] == "torchstrategies" and len(parts) > 1 and parts[1] in LAYERS:
                    used.add(parts[1])
    own = name.rstrip("/").removesuffix(".py")
    return used - {own}


def test_the_table_covers_every_folder_and_file_beside_the_layers():
    rows = _table()
    assert {"bench/", "cli/", "nn/", "checkpoint.py", "cluster_resolver/", "coordinator.py"} <= set(rows)


def test_each_row_names_exactly_the_layers_it_imports():
    wrong = {name: (sorted(uses), sorted(_imports(name))) for name, uses in _table().items()
             if uses != _imports(name)}
    assert wrong == {}, "docs/architecture.md (documented, imported): " + repr(wrong)
