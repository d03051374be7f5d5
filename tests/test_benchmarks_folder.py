"""benchmarks/ (the design card's folder): thin entry points over ``torchstrategies bench``, a README with
their commands, the latest figures as JSON + plot stamped with command, date, machine and load, and
``make bench`` regenerating them (issue 39, item 2)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from torchstrategies.cli.bench_cmds import BENCH_MODULES
from torchstrategies_cli.bench import bench

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
ENTRY_POINTS = {"kernels": "kernels", "allreduce": "allreduce", "train": "train", "train_ps": "train-ps"}


def _args(stem: str) -> list[str]:
    spec = importlib.util.spec_from_file_location(f"_bench_{stem}", BENCH / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return list(module.ARGS)


@pytest.mark.parametrize("stem", sorted(ENTRY_POINTS))
def test_each_entry_point_is_a_valid_torchstrategies_bench_command(stem):
    name = ENTRY_POINTS[stem]
    assert name in BENCH_MODULES
    bench.commands[name].make_context(name, _args(stem))  # click parses it as the CLI would (no run)


@pytest.mark.parametrize("stem", sorted(ENTRY_POINTS))
def test_the_readme_shows_each_entry_points_exact_command(stem):
    command = shlex.join(["torchstrategies", "bench", ENTRY_POINTS[stem], *_args(stem)])
    assert f"| `{stem}.py` | `{command}` |" in (BENCH / "README.md").read_text()


@pytest.mark.parametrize("stem", sorted(ENTRY_POINTS))
def test_the_latest_figures_are_stamped_with_command_date_machine_and_load(stem):
    data = json.loads((BENCH / "results" / f"{stem}.json").read_text())
    assert (BENCH / "results" / f"{stem}.png").stat().st_size > 0
    rec = data["meta"]["recorded"]
    assert rec["command"] == shlex.join(["torchstrategies", "bench", ENTRY_POINTS[stem], *_args(stem)])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", rec["date_utc"]) and rec["machine"]
    assert isinstance(rec["load_1min_start"], float) and data["rows"]
    assert rec["date_utc"] in data["title"]


def test_make_bench_runs_every_entry_point():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\nbench:"):].split("\n\n")[0]
    assert all(stem in recipe for stem in ENTRY_POINTS) and "benchmarks/" in recipe
