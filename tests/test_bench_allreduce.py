"""The real all-reduce benchmark, end to end on 2 ranks (tiny sizes): rounds, warm-up agreement, table."""

from __future__ import annotations

import pytest

from torchstrategies.bench import allreduce


@pytest.mark.timeout(180)
def test_allreduce_bench_runs_interleaved_rounds_and_reports_every_case():
    impls = ["shm", "shm-zero-copy", "shm-comm", "dist-backend"]
    r = allreduce.run(nproc=2, sizes=[4096, 65536], implementations=impls, progress=False, rounds=2, timeout=150)
    cases = {(row["size"], row["implementation"]) for row in r.rows}
    assert cases == {(s, i) for s in ("4 KiB", "64 KiB") for i in ["gloo", *impls]}
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


def test_busbw_is_the_nccl_tests_all_reduce_formula():
    assert allreduce.busbw(1.0, 2) == 1.0
    assert allreduce.busbw(2.0, 4) == pytest.approx(3.0)  # 2 * 2 * 3 / 4
    assert allreduce.busbw(3.0, 3) == pytest.approx(4.0)  # 3 * 2 * 2 / 3
    assert allreduce.busbw(5.0, 1) == 0.0


def test_table_derives_algbw_busbw_and_the_roofline_fraction_from_the_times():
    data = {"rows": [{"size": 1 << 20, "implementation": "gloo", "seconds": 4e-3},
                     {"size": 1 << 20, "implementation": "ring", "seconds": 2e-3},
                     {"size": 1 << 20, "implementation": allreduce.ROOFLINE, "seconds": 1e-3}],
            "packed": None, "rounds": 1, "hosts": ["a"] * 4}
    rows = {r["implementation"]: r for r in allreduce._table(data, 4).rows}
    assert rows["ring"]["algbw_GBps"] == pytest.approx((1 << 20) / 2e-3 / 1e9)
    assert rows["ring"]["busbw_GBps"] == pytest.approx(rows["ring"]["algbw_GBps"] * 1.5)
    assert rows["ring"]["speedup_vs_gloo"] == pytest.approx(2.0)
    assert rows["ring"]["fraction_of_roofline"] == pytest.approx(0.5)
    assert rows["gloo"]["fraction_of_roofline"] == pytest.approx(0.25)
    assert rows[allreduce.ROOFLINE]["fraction_of_roofline"] == pytest.approx(1.0)


@pytest.mark.timeout(180)
def test_tiny_run_reports_a_positive_loopback_roofline_beside_gloo():
    r = allreduce.run(nproc=2, sizes=[4096], implementations=[allreduce.ROOFLINE], progress=False, rounds=1,
                      timeout=150)
    rows = {row["implementation"]: row for row in r.rows}
    assert set(rows) == {"gloo", allreduce.ROOFLINE}
    roof = rows[allreduce.ROOFLINE]
    assert roof["median_us"] > 0 and roof["algbw_GBps"] > 0 and roof["busbw_GBps"] > 0
    assert roof["fraction_of_roofline"] == pytest.approx(1.0)
    assert rows["gloo"]["fraction_of_roofline"] > 0
    assert "load " in r.title and r.meta["machine"] in r.title
    assert any("127.0.0.1" in n for n in r.notes)


@pytest.mark.timeout(240)
def test_simulate_hosts_gives_each_half_of_the_ranks_its_own_host_id():
    r = allreduce.run(nproc=4, simulate_hosts=2, sizes=[4096], implementations=["hierarchical"], progress=False,
                      rounds=1, timeout=220)
    assert r.meta["hosts"] == ["simulated-host-0", "simulated-host-0", "simulated-host-1", "simulated-host-1"]
    assert r.meta["hierarchical_hosts"] == 2  # HIERARCHICAL really ran its inter-host stage
    assert r.meta["hierarchical_plan"] == "HIERARCHICAL"
    assert {row["implementation"] for row in r.rows} == {"gloo", "hierarchical"}
    assert "2 simulated hosts x 2" in r.title


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 4, "simulate_hosts": 3}, "simulate_hosts must be >= 1 and divide nproc=4, got 3"),
    ({"nproc": 4, "simulate_hosts": 2, "implementations": ["shm", "ring"]}, r"\['shm'\] need every rank on one"),
    ({"nproc": 2, "implementations": ["roofline"]}, r"unknown implementations \['roofline'\]"),
    ({"nproc": 2, "sizes": [2]}, r"sizes must be a non-empty list of byte counts >= 4, got \[2\]"),
])
def test_bad_arguments_are_refused_before_anything_is_launched(kwargs, message):
    with pytest.raises(ValueError, match=message):
        allreduce.run(progress=False, **kwargs)


def test_a_bad_socket_buffer_setting_is_refused(monkeypatch):
    monkeypatch.setenv("TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES", "big")
    with pytest.raises(ValueError, match="TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES must be a whole number"):
        allreduce.run(nproc=2, progress=False)


def _check_bodies(rank, world):
    import torch
    import torch.distributed as dist

    from torchstrategies.bench import allreduce_worker as w
    from torchstrategies.bench.loopback import LoopbackRing

    t = torch.zeros(5)
    w._check_all_reduce("gloo", 20, t, lambda: dist.all_reduce(t))  # a right sum passes
    ring = LoopbackRing(dist.distributed_c10d._get_default_store(), rank, world, timeout=30)
    w._Roofline(ring, 4099).check()  # 2(n-1)/n * 4099 bytes arrive intact from the left neighbour
    ring.close()
    try:
        w._check_all_reduce("broken", 20, t, lambda: None)  # leaves each rank's own input: wrong
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_the_worker_checks_catch_a_wrong_sum_on_every_rank():
    from harness import run_ranks

    messages = run_ranks(_check_bodies, 3, timeout=100)
    for rank, msg in enumerate(messages):
        assert msg is not None and msg.startswith("all-reduce 'broken' of 20 bytes gave a wrong result on ranks "
                                                  "[0, 1, 2]; on rank "), msg
        assert f"on rank {rank}:" in msg
