"""The real all-reduce benchmark, end to end on 2 ranks (tiny sizes): rounds, warm-up agreement, table."""

from __future__ import annotations

import pytest

from torchstrategies.bench import allreduce


@pytest.mark.timeout(180)
def test_allreduce_bench_runs_interleaved_rounds_and_reports_every_case():
    r = allreduce.run(nproc=2, sizes=[4096, 65536], implementations=["shm", "shm-zero-copy"], progress=False,
                      rounds=2, timeout=150)
    cases = {(row["size"], row["implementation"]) for row in r.rows}
    assert cases == {(s, i) for s in ("4 KiB", "64 KiB") for i in ("gloo", "shm", "shm-zero-copy")}
    for row in r.rows:
        assert row["median_us"] > 0
        assert row["speedup_vs_gloo"] == pytest.approx(
            next(x["median_us"] for x in r.rows if x["size"] == row["size"] and x["implementation"] == "gloo")
            / row["median_us"])
    assert any("median of 2 interleaved rounds" in n for n in r.notes)
    assert set(r.meta["packed_seconds"]) == {"gloo-100-calls", "shm", "gloo"}


def test_allreduce_bench_rejects_bad_rounds():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        allreduce.run(nproc=2, rounds=0)
