"""Faults: an absent peer ends in DeadlineExceededError, a dead one in UnavailableError, never a hang; no
leftovers."""

from __future__ import annotations

import _coll_bodies as B
import pytest
from harness import run_ranks

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py


@pytest.mark.timeout(60)
def test_absent_peer_raises_deadline_exceeded_naming_it():
    res = run_ranks(B.absent_peer_both, 2, timeout=50, pg_timeout=30)
    assert res[1] == {"SHM": "absent", "RING": "absent", "RING-async": "absent"}
    for impl in ("SHM", "RING", "RING-async"):
        msg = res[0][impl]
        assert msg.startswith("raised after"), msg
        assert "ranks [1]" in msg and "all_reduce" in msg and "global ranks [0, 1]" in msg, (impl, msg)


@pytest.mark.timeout(60)
def test_dead_peer_makes_the_others_raise_not_hang():
    res = run_ranks(B.dead_peer, 3, timeout=50, expect_failure=[1], pg_timeout=30)
    assert res[1] is None  # killed itself
    for r in (0, 2):
        assert ("ranks [1]" in res[r] and "died" in res[r]) or "gave up" in res[r], res[r]
        assert "again: UnavailableError" in res[r], res[r]
