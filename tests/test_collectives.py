"""The public API (torchstrategies.collectives) with every implementation against torch.distributed.all_reduce,
on 1-4 gloo ranks (AUTO, SHM, RING run on a "torchstrategies" backend made over the gloo group's ranks).

Spawning ranks dominates the run time on a 2-core machine, so one 2-rank run (a module fixture)
serves several tests; each test asserts its own part of the results.
"""

from __future__ import annotations

import glob

import _coll_bodies as B
import pytest
from harness import run_ranks

ALL = ["SHM", "RING", "GLOO", "AUTO"]  # + "SHM-BUF": SHM on a collectives.buffer() tensor
OPS = ["SUM", "MEAN", "MIN", "MAX"]
DTYPES = ["float32", "float64", "bfloat16", "float16", "int32", "int64"]


pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store") / "file_store")
    before = set(glob.glob("/dev/shm/torchstrat*"))
    big = [(i, "SUM", "float32") for i in ALL + ["SHM-BUF"]] + [
        ("SHM", "MAX", "int64"), ("SHM", "MEAN", "float64"), ("SHM-BUF", "MIN", "bfloat16"),
        ("SHM-BUF", "MEAN", "float64")]
    res = run_ranks(B.suite2, 2, timeout=150, args=((ALL, OPS, DTYPES, [0, 1, 7, 4097], big), store))
    left = set(glob.glob("/dev/shm/torchstrat*")) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
    return res


def _ok(results):
    for r, fails in enumerate(results):
        assert fails == [], f"rank {r}: {fails[:10]}"


@pytest.mark.timeout(160)
def test_world_2_every_implementation_op_dtype_and_size_matches_gloo(world2):
    _ok([r["matrix"] for r in world2])


def test_many_tensors_mixed_dtypes_are_packed_and_copied_back(world2):
    _ok([r["packing"] for r in world2])


def test_async_zero_copy_buffer_broadcast_and_all_gather(world2):
    for r in world2:
        a = r["async"]
        assert set(a) == {"in_shm", "same_object", "futures", "buf_ok", "max_ok", "bcast_ok", "bcast_gloo_ok",
                          "gather_ok"}
        assert all(a.values()), a


def test_repeated_calls_give_fresh_results_and_follow_mutated_options(world2):
    for r in world2:
        fp = r["fast_path"]
        assert fp["sums"] == [float(1 + 2 + 2 * step) for step in range(5)]
        assert fp["after"] == 3.0 and fp["chosen"] == "GLOO"


def test_shm_reduces_a_list_in_place_as_one_buffer_across_every_boundary(world2):
    _ok([r["many"] for r in world2])


@pytest.mark.timeout(120)
def test_shm_list_on_three_ranks_and_mismatched_lists_raise():
    res = run_ranks(B.many_and_mismatch, 3, timeout=110)
    _ok([r["many"] for r in res])
    for r in res:
        assert r["aliased"] is True  # the same tensor twice and a view of it: each reduced once
        assert "collective mismatch" in r["mismatch"] and "number of tensors" in r["mismatch"], r["mismatch"]


def test_destroy_process_group_frees_the_group_and_a_new_group_gets_working_shm(world2):
    for r in world2:
        assert r["lifetime"] == {"freed": True, "after": 6.0}  # (1 + 2) after one SUM, 6 after the second


def test_bad_input_raises_clear_errors(world2):
    msgs = world2[0]["bad_input"]
    assert msgs[0].startswith("TypeError") and "MEAN" in msgs[0]
    assert msgs[1].startswith("ValueError") and "TREE was removed" in msgs[1]
    assert msgs[2].startswith("TypeError") and "tensors[1]" in msgs[2]
    assert msgs[3].startswith("ValueError") and "'prod'" in msgs[3]
    assert msgs[4].startswith("ValueError") and "NCCL" in msgs[4]
    assert msgs[5].startswith("ValueError") and "src 2" in msgs[5]


def test_debug_mode_catches_a_shape_mismatch_naming_both_calls(world2):
    for r in world2:
        d = r["debug"]
        assert "collective mismatch" in d, d
        assert "[3] torch.float32" in d and "[4] torch.float32" in d, d
        assert "rank 0" in d and "rank 1" in d, d


def test_shm_detects_mismatched_sizes_without_debug_mode_and_the_group_keeps_working(world2):
    for r in world2:
        m = r["shm_mismatch"]
        assert "collective mismatch" in m and "numel=3" in m and "numel=4" in m, m
        assert r["after_mismatch"] == 3.0


@pytest.mark.timeout(120)
def test_world_1_and_3_match_gloo():
    _ok(run_ranks(B.matrix, 1, timeout=60, args=(ALL, OPS, ["float32", "int64"], [0, 5])))
    _ok(run_ranks(B.matrix, 3, timeout=80, args=(
        ["SHM", "RING"], OPS, ["float32", "int32"], [1, 4097],
        [("SHM", "SUM", "float32"), ("SHM-BUF", "SUM", "float32"), ("SHM-BUF", "MAX", "int32")])))


@pytest.mark.timeout(90)
def test_world_4_matches_gloo():
    _ok(run_ranks(B.matrix, 4, timeout=80, args=(
        ["SHM", "RING", "SHM-BUF"], ["SUM", "MEAN", "MIN"], ["float32", "int64"], [1, 70001])))


@pytest.mark.timeout(90)
def test_hierarchical_two_simulated_hosts_of_two_ranks():
    res = run_ranks(B.hierarchical, 4, timeout=80,
                    env_per_rank=lambda r: {"TORCHSTRATEGIES_HOST_ID": f"host{r // 2}"})
    for r in res:
        assert r["fails"] == []
        assert r["auto"] == "HIERARCHICAL"
        assert r["hosts"] == ["host0", "host0", "host1", "host1"]
        assert "one host" in r["shm_err"]
