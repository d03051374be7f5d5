"""Issue 27, items 4-7: collective faults that used to hang or go wrong, now named errors on every rank."""

from __future__ import annotations

import _fault_bodies as F
import pytest
from harness import run_ranks

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py

_HOSTS_2_1 = lambda r: {"TORCHSTRATEGIES_HOST_ID": "hostA" if r < 2 else "hostB"}  # noqa: E731


@pytest.mark.timeout(90)
@pytest.mark.parametrize("impl", ["RING", "AUTO"])
def test_a_frozen_rank_0_hosting_the_store_does_not_hang_the_others(impl, tmp_path):
    # item 4: the error path's store calls are bounded, so rank 1 raises instead of blocking on the store
    timeout = 5.0
    res = run_ranks(F.frozen_store_host, 2, args=(impl, timeout, str(tmp_path)), timeout=80, pg_timeout=60,
                    expect_failure=[0])
    kind, msg, took = res[1]
    assert kind == "DeadlineExceededError", (kind, msg)
    assert "[0]" in msg, msg
    assert took < 3 * timeout + 10, took


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl, world, hosts", [("RING", 2, None), ("RING", 3, None),
                                                ("HIERARCHICAL", 3, _HOSTS_2_1)])
def test_ranks_calling_different_collectives_raise_value_error_on_every_rank(impl, world, hosts):
    # item 5: without debug mode; then the group keeps working
    res = run_ranks(F.mismatched_collectives, world, args=(impl,), timeout=110, env_per_rank=hosts)
    total = float(world * (world + 1) // 2)
    for rank, out in enumerate(res):
        for case in ("broadcast", "all_gather", "all_reduce_max"):
            assert out[case].startswith("ValueError: collective mismatch"), (rank, case, out[case])
            assert out[case + "_after"] == [total] * 3, (rank, case, out[case + "_after"])
        assert "broadcast" in out["broadcast"] and "all_reduce" in out["broadcast"], out["broadcast"]
        assert "all_gather" in out["all_gather"], out["all_gather"]
        assert "differs in op" in out["all_reduce_max"], out["all_reduce_max"]


@pytest.mark.timeout(90)
def test_a_ring_set_up_only_one_rank_attempted_does_not_break_later_groups():
    # item 6: no set-up counter keyed by the set of ranks that could drift. The lone set-up is bounded by the
    # call's timeout (3 s), not the world's (60 s here): the error says which, so a set-up that waits out the
    # group's timeout fails this test instead of passing a minute later.
    res = run_ranks(F.ring_set_up_by_one_rank, 2, timeout=80)
    alone = res[0]["alone"]
    assert alone.startswith("DeadlineExceededError: set-up on world"), alone
    assert "ranks [1] did not arrive within 3 s" in alone, alone
    assert "wait timeout" in alone and "store did not answer" not in alone, alone  # the store answered
    for out in res:
        assert out["new_group_0"] == [3.0, 3.0, 3.0] and out["new_group_1"] == [3.0, 3.0, 3.0], out


@pytest.mark.timeout(90)
def test_torchstrategies_debug_on_one_rank_only_raises_value_error_naming_it_on_both():
    # item 7: agreed when a group is first used (gloo) or made (the torchstrategies backend)
    res = run_ranks(F.debug_on_one_rank, 2, timeout=80,
                    env_per_rank=lambda r: {"TORCHSTRATEGIES_DEBUG": "1"} if r == 0 else {})
    for rank, out in enumerate(res):
        for impl, msg in out.items():
            assert msg.startswith("ValueError") and "TORCHSTRATEGIES_DEBUG" in msg, (rank, impl, msg)
