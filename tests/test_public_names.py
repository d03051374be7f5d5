"""Every name the README, the docs and the examples import or name from torchstrategies resolves.

The docs' Python blocks run in tests/test_docs.py; this test also covers the names written in prose, in
shell and text blocks and in the examples (``ts.coordinator.ClusterCoordinator``,
``from torchstrategies.parallel import X``...), so moving a module cannot silently break a path users copy.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import _available

ROOT = Path(__file__).resolve().parents[1]
_FROM = re.compile(r"from\s+(torchstrategies(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w ,]+)")
_IMPORT = re.compile(r"^\s*import\s+(torchstrategies(?:\.\w+)*)", re.M)
# A dotted name in code or prose; not one inside a string or a path (logger names, gRPC service names).
_DOTTED = re.compile(r"(?<![\w./\"'])(ts|torchstrategies)((?:\.[A-Za-z_]\w*)+)")

# Dotted words in the docs that are not Python names, with where they stand.
_NOT_NAMES = {"torchstrategies.example": "a logger name in docs/logging.md's log-line example",
              "torchstrategies.multi_worker": "MultiWorkerMirroredStrategy's logger, in docs/logging.md's table"}


def _sources() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("**/*.md"))
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").glob("**/*.py"))]


def _names(text: str) -> set[str]:
    found = set()
    for module, names in _FROM.findall(text):
        for name in names.strip("()").replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name and name != "*":
                found.add(f"{module}.{name}")
    found.update(_IMPORT.findall(text))
    for _alias, rest in _DOTTED.findall(text):
        found.add("torchstrategies" + rest.rstrip("."))
    return found


def _cases() -> list[tuple[str, str]]:
    return sorted({(name, str(p.relative_to(ROOT))) for p in _sources() for name in _names(p.read_text())
                   if name not in _NOT_NAMES})


@pytest.mark.parametrize("name,where", _cases())
def test_name_used_in_docs_resolves(name: str, where: str) -> None:
    assert _available(name), f"{where} names {name}, which is no module of torchstrategies nor an attribute of one"


def test_the_scan_finds_the_public_names() -> None:
    # The patterns must keep finding what users copy, or the test above silently checks nothing.
    names = {n for n, _ in _cases()}
    for expected in ("torchstrategies.MirroredStrategy", "torchstrategies.ParameterServerStrategy",
                     "torchstrategies.coordinator.ClusterCoordinator"):
        assert expected in names
