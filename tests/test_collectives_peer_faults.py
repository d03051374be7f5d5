"""Every implementation, a dead peer (SIGKILL) and a frozen one (SIGSTOP): the others raise a named error
within the timeout, never hang. Gone -> UnavailableError, late -> DeadlineExceededError (issues 14, 18)."""

from __future__ import annotations

import _fault_bodies as F
import pytest
from harness import run_ranks

# 2 ranks where that shows the behaviour; 3 where the dead rank is not every survivor's neighbour (RING), or
# where one host has a second rank that must hear of the failure (HIERARCHICAL: hosts {0, 1} and {2}).
_WORLD = {"SHM": 2, "RING": 3, "GLOO": 2, "HIERARCHICAL": 3}
_HOSTS = {"HIERARCHICAL": lambda r: {"TORCHSTRATEGIES_HOST_ID": "hostA" if r < 2 else "hostB"}}
_TIMEOUT = 8.0


pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, expected", [("kill", "UnavailableError"), ("stop", "DeadlineExceededError")])
@pytest.mark.parametrize("impl", ["SHM", "RING", "GLOO", "HIERARCHICAL"])
def test_dead_or_frozen_peer_raises_named_error_on_every_other_rank(impl, how, expected):
    world = _WORLD[impl]
    victim = world - 1
    res = run_ranks(F.peer_fault, world, args=(impl, how, _TIMEOUT), timeout=80, pg_timeout=60,
                    expect_failure=[victim], env_per_rank=_HOSTS.get(impl))
    for rank in range(world - 1):
        kind, msg = res[rank]
        assert kind == expected, (rank, kind, msg)
        assert "all_reduce" in msg, msg
        # the error names the rank that is gone / late (also on a rank that is not its neighbour)
        assert f"[{victim}]" in msg or f"rank {victim}" in msg, (rank, msg)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "term"])
def test_segment_is_unlinked_at_exit_and_on_sigterm_while_waiting_for_peers(how):
    import multiprocessing as mp
    import os
    import secrets

    name = f"/torchstrat_test_{secrets.token_hex(6)}"
    p = mp.get_context("spawn").Process(target=F.segment_then_signal, args=(name, how))
    p.start()
    p.join(50)
    assert p.exitcode is not None, "the process did not end"
    assert not os.path.exists("/dev/shm" + name), f"{name} left in /dev/shm after {how}"
