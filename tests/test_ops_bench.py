"""The kernel benchmark's structure on a tiny run (speed is never asserted in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from torchstrategies.bench import kernels
from torchstrategies.bench.report import BenchResult


def test_run_returns_one_row_per_thread_count_case_and_method() -> None:
    before = torch.get_num_threads()
    r = kernels.run(ns=(2, 3), sizes=(1000, 4097), repeats=2, progress=False, threads=(1, 3))
    assert torch.get_num_threads() == before  # restored
    assert isinstance(r, BenchResult)
    assert r.columns == ["threads", "N", "elements", "method", "ms", "GB/s", "% roof",
                         "x loop"]
    assert len(r.rows) == 2 * 2 * 2 * len(kernels.METHODS)
    assert {row["method"] for row in r.rows} == set(kernels.METHODS)
    assert [row["threads"] for row in r.rows] == [1] * (len(r.rows) // 2) + [3] * (len(r.rows) // 2)
    assert r.meta["threads"] == [1, 3] and set(r.meta["roofline_gbps"]) == {1, 3}
    loop_ms = {(row["threads"], row["N"], row["elements"]): row["ms"] for row in r.rows
               if row["method"] == "add_ loop"}
    for row in r.rows:
        assert set(row) == set(r.columns)
        assert row["ms"] > 0 and row["GB/s"] > 0
        read_only = row["method"] == "hash_tensors"   # reads its N inputs, writes no output
        gbps = (row["N"] + (not read_only)) * row["elements"] * 4 / (row["ms"] / 1e3) / 1e9
        assert row["GB/s"] == pytest.approx(gbps)
        roof = r.meta["roofline_gbps"][row["threads"]][row["elements"]]  # the copy at the row's thread count
        assert row["% roof"] == pytest.approx(100 * row["GB/s"] / roof)
        key = (row["threads"], row["N"], row["elements"])
        assert row["x loop"] == pytest.approx(loop_ms[key] / row["ms"])
        if row["method"] == "add_ loop":
            assert row["x loop"] == 1.0
    assert "| accumulate_n |" in r.markdown()


def test_default_thread_counts_are_one_and_torchs_current() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert kernels.thread_counts() == [1, 3]
        torch.set_num_threads(1)
        assert kernels.thread_counts() == [1]
    finally:
        torch.set_num_threads(before)
    assert kernels.thread_counts(2) == [2]
    assert kernels.thread_counts([4, 1, 4]) == [4, 1]
    for bad in ([], [0], 0, [1, -2]):
        with pytest.raises(ValueError, match="threads must be one or more integers >= 1"):
            kernels.thread_counts(bad)


def test_cli_measures_every_row_at_each_thread_count(tmp_path: Path) -> None:
    from torchstrategies_cli import main

    out = tmp_path / "k.json"
    args = ["bench", "kernels", "--n", "2", "--size", "1000", "--repeats", "1", "--threads", "1", "--threads",
            "2", "--no-progress", "--json", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert sorted({(row["threads"], row["method"]) for row in rows}) == sorted(
        (t, m) for t in (1, 2) for m in kernels.METHODS)


def test_run_rejects_empty_arguments() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        kernels.run(ns=(), progress=False)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = kernels.run(ns=(2,), sizes=(1000,), repeats=1, progress=False, threads=(1, 2))
    path = tmp_path / "k.png"
    kernels.plot(r, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_markdown_and_writes_json(tmp_path: Path) -> None:
    """What benchmarks/kernels.py did before it was folded into the command: --markdown beside --json."""
    from torchstrategies_cli import main

    out = tmp_path / "k.json"
    args = ["bench", "kernels", "--n", "2", "--size", "1000", "--repeats", "1", "--threads", "1", "--threads", "2",
            "--no-progress", "--markdown", "--json", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2 * len(kernels.METHODS)
    assert {row["threads"] for row in data["rows"]} == {1, 2}
    assert "| threads | N | elements | method |" in result.output and "| add_ loop |" in result.output


def test_compare_races_the_kernels_at_one_thread_count() -> None:
    from torchstrategies.cli.compare import _at_one_thread_count, advice

    # At 1 thread tree_reduce wins, at the default 2 threads accumulate_n: the advice is the 2-thread race.
    times = {(1, "tree_reduce"): 1.0, (1, "accumulate_n"): 2.0, (2, "tree_reduce"): 0.9, (2, "accumulate_n"): 0.5}
    rows = [{"threads": t, "N": 8, "elements": 1 << 20, "method": m, "ms": ms, "GB/s": 1.0, "% roof": 1.0,
             "x loop": 1.0} for (t, m), ms in times.items()]
    meta = {"default_threads": 2, "roles": {"impl": "method", "size": "elements", "time": "ms", "group": "N"}}
    r = _at_one_thread_count(BenchResult("k", list(kernels.COLUMNS), rows, [], meta))
    assert {row["threads"] for row in r.rows} == {2}
    assert [row["use"] for row in advice({"kernels": r}).rows] == ["accumulate_n"]
    single = BenchResult("k", list(kernels.COLUMNS), rows[:2], [], meta)
    assert _at_one_thread_count(single).rows == rows[:2]  # one thread count: unchanged


def test_compare_never_advises_the_hash_for_summing() -> None:
    """hash_tensors is a row of bench kernels (the agreement seam's fingerprint, a reference figure), not a way
    to sum tensors: compare leaves it out of the race even where it is the fastest row (it was advised as
    'use' at 16M elements, N=4, in `make demo`)."""
    from torchstrategies.cli.compare import advice

    r = kernels.run(ns=(2,), sizes=(1000,), repeats=1, progress=False, threads=(1,))
    for row in r.rows:
        row["ms"] = 1e-9 if row["method"] == "hash_tensors" else 1.0 + len(row["method"]) * 1e-3
    rows = advice({"kernels": r}).rows
    assert [row["use"] for row in rows] == ["add_n"]  # the fastest sum: the shortest name by construction
    assert all(row["runner-up"] != "hash_tensors" for row in rows)
