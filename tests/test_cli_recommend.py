"""compare's analysis: finding the columns' roles and the winner at each size."""

from __future__ import annotations

import pytest

from torchstrategies.bench.report import BenchResult
from torchstrategies.cli.recommend import detect_roles, parse_number, series, size_ranges, winners


def test_roles_are_guessed_from_common_column_names():
    r = BenchResult("k", ["kernel", "N", "elements", "median (ms)", "GB/s", "% roofline"])
    roles = detect_roles(r)
    assert (roles.impl, roles.group, roles.size, roles.metric, roles.minimize) == (
        "kernel",
        "N",
        "elements",
        "median (ms)",
        True,
    )


def test_roles_fall_back_to_a_rate_to_maximize_when_there_is_no_time():
    roles = detect_roles(BenchResult("a", ["implementation", "message size", "busbw GB/s"]))
    assert (roles.impl, roles.size, roles.metric, roles.minimize) == (
        "implementation",
        "message size",
        "busbw GB/s",
        False,
    )


def test_declared_roles_win_over_guesses():
    r = BenchResult(
        "x", ["who", "how big", "t"], meta={"roles": {"impl": "who", "size": "how big", "time": "t"}}
    )
    roles = detect_roles(r)
    assert (roles.impl, roles.size, roles.metric, roles.minimize) == ("who", "how big", "t", True)


def test_undetectable_columns_raise_naming_the_columns_and_the_fix():
    with pytest.raises(ValueError, match=r"columns: \['a', 'b'\].*meta\['roles'\]"):
        detect_roles(BenchResult("odd", ["a", "b"]))
    with pytest.raises(ValueError, match="not in"):
        detect_roles(BenchResult("x", ["impl", "size", "ms"], meta={"roles": {"time": "nope"}}))


@pytest.mark.parametrize(
    "value,kind,expected",
    [
        (1.5, "time", 1.5),
        ("1.5 ms", "time", 1.5e-3),
        ("20us", "time", 20e-6),
        ("3 s", "time", 3.0),
        ("4 KiB", "size", 4096),
        ("16M", "size", 16 << 20),
        ("1.25x", "plain", 1.25),
        ("n/a", "time", None),
        (None, "plain", None),
        (True, "plain", None),
        ("7 parsecs", "time", None),
        (float("nan"), "plain", None),
    ],
)
def test_parse_number_understands_units(value, kind, expected):
    got = parse_number(value, kind=kind)
    assert got == pytest.approx(expected) if expected is not None else got is None


def _table(rows, cols=("impl", "size", "median (ms)"), **meta):
    return BenchResult("t", list(cols), [dict(zip(cols, r, strict=True)) for r in rows], meta=dict(meta))


def test_winner_per_size_with_runner_up_and_margin_and_unit_strings():
    r = _table(
        [
            ("gloo", "4 KiB", "200 us"),
            ("shm", "4 KiB", "5 us"),
            ("ring", "4 KiB", "0.09 ms"),
            ("gloo", "64 MiB", "0.5 s"),
            ("shm", "64 MiB", "180 ms"),
            ("ring", "64 MiB", "120 ms"),
        ]
    )
    ws = winners(r)
    assert [(w.size_label, w.best, w.runner_up) for w in ws] == [
        ("4 KiB", "shm", "ring"),
        ("64 MiB", "ring", "shm"),
    ]
    assert ws[0].margin == pytest.approx(18.0)
    assert ws[1].margin == pytest.approx(1.5)
    assert ws[0].size == 4096 and ws[1].size == 64 << 20


def test_only_reference_rows_are_excluded_not_implementations_named_copy():
    r = _table([("copy", 1024, 0.1), ("memcpy", 1024, 0.1), ("shm-zero-copy", 1024, 0.5), ("shm", 1024, 0.9)])
    (w,) = winners(r)
    assert (w.best, w.runner_up) == ("shm-zero-copy", "shm")


def test_winners_maximize_rates_and_skip_baselines():
    r = _table(
        [("copy (roofline)", 1024, 50.0), ("a", 1024, 10.0), ("b", 1024, 12.0), ("ref", 1024, 99.0)],
        cols=("kernel", "elements", "GB/s"),
        baselines=["ref"],
    )
    (w,) = winners(r)
    assert (w.best, w.runner_up) == ("b", "a")


def test_winners_are_per_group_and_sorted_by_numeric_size():
    # N=2: x wins at 1K, y from 64K up. N=16: x wins everywhere (16 sorts after 2, as a number).
    # Rows deliberately out of order.
    times = {
        (2, 1 << 20): (2.0, 1.0),
        (2, 1024): (1.0, 2.0),
        (2, 65536): (3.0, 1.0),
        (16, 65536): (1.0, 4.0),
        (16, 1024): (1.0, 2.0),
        (16, 1 << 20): (1.0, 1.5),
    }
    rows = []
    for (n, size), (tx, ty) in times.items():
        rows += [("x", n, size, tx), ("y", n, size, ty)]
    r = _table(rows, cols=("kernel", "N", "elements", "median (ms)"))
    ws = winners(r)
    assert [(w.group, w.size) for w in ws] == [
        (2, 1024),
        (2, 65536),
        (2, 1 << 20),
        (16, 1024),
        (16, 65536),
        (16, 1 << 20),
    ]
    assert size_ranges([w for w in ws if w.group == 2]) == [("1024", "1024", "x"), ("65536", "1048576", "y")]
    assert size_ranges([w for w in ws if w.group == 16]) == [("1024", "1048576", "x")]


def test_series_groups_points_for_plotting_sorted_by_size():
    r = _table([("a", "1M", 2.0), ("a", "1K", 1.0), ("b", "1K", "oops")])
    assert series(r) == {None: {"a": [(1024.0, 1.0), (1048576.0, 2.0)]}}


def test_compare_never_recommends_a_reference_row_of_the_allreduce_benchmark():
    """shm-comm (the communicator called directly) is a reference a user cannot choose (issue 39)."""
    from torchstrategies.bench import allreduce

    rows = [{"implementation": impl, "size": size, "seconds": seconds}
            for size in (4096, 1 << 20)
            for impl, seconds in (("gloo", 1e-3), ("shm-comm", 1e-6), ("shm", 2e-6), ("loopback-roofline", 1e-7))]
    result = allreduce._table({"rows": rows, "machine": "test"}, 2)
    assert {w.best for w in winners(result)} == {"shm"}
