"""What the collectives remember about a process group lives in its GroupState, which goes with the group;
``topology.clear_caches`` forgets the host-derived facts and retires the targets made from them (issue 29)."""

from __future__ import annotations

import gc
import weakref

import pytest
from harness import run_ranks

from torchstrategies.collectives.group_state import GroupState, Target
from torchstrategies.collectives.options import CommunicationImplementation as Impl


class _Group:  # a weakly referenceable stand-in: GroupState needs nothing else of a group
    pass


def test_a_group_state_is_one_per_group_and_goes_with_its_group():
    g = _Group()
    state = GroupState.of(g)
    assert GroupState.of(g) is state
    assert GroupState.of(_Group()) is not state
    state.ranks, state.seq = [0, 1], 4
    gone = weakref.ref(g)
    del g
    gc.collect()
    assert gone() is None  # the state does not keep its group alive
    assert all(s is not state for s in GroupState._of.values())


def test_clear_caches_forgets_host_facts_keeps_peers_and_sequence_and_retires_targets():
    g = _Group()
    state = GroupState.of(g)
    state.ranks, state.hosts, state.description, state.timeout = [0, 1], ["a", "b"], "world", 5.0
    state.peers, state.seq = [(1, 100), (1, 101)], 7
    target = Target(object(), True, True, False)
    before = GroupState.generation()
    assert target.generation == before
    GroupState.clear_caches()
    assert GroupState.generation() == before + 1 != target.generation
    assert (state.ranks, state.hosts, state.description, state.timeout) == (None, None, None, None)
    assert (state.peers, state.seq) == ([(1, 100), (1, 101)], 7)


def _learns_and_relearns(rank, world_size):
    import os

    import torch
    import torch.distributed as dist

    from torchstrategies import collectives as C
    from torchstrategies.collectives import topology

    g = C.new_group(C.CommunicationOptions(implementation="GLOO"))
    x = C.all_reduce(torch.ones(3), group=g, options=C.CommunicationOptions(implementation="GLOO"))
    state = GroupState.of(g)
    first = state.targets[(Impl.GLOO, False)]
    pids = [torch.tensor([os.getpid()]) for _ in range(world_size)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    out = {"sum": x.tolist(), "ranks": state.ranks, "description": state.description, "timeout": state.timeout,
           "peer_pids": [p for _, p in state.peers], "pids": [int(p) for p in pids]}
    topology.clear_caches()
    out["after_clear"] = (state.ranks, state.description)
    y = C.all_reduce(torch.ones(3), group=g, options=C.CommunicationOptions(implementation="GLOO"))
    out["sum_again"] = y.tolist()
    out["remade"] = state.targets[(Impl.GLOO, False)] is not first
    out["ranks_again"] = state.ranks
    return out


@pytest.mark.timeout(120)
def test_a_group_s_state_holds_its_facts_and_peers_and_clear_caches_remakes_its_target():
    for out in run_ranks(_learns_and_relearns, 2, timeout=110):
        assert out["sum"] == [2.0, 2.0, 2.0] and out["sum_again"] == [2.0, 2.0, 2.0]
        assert out["ranks"] == [0, 1] and out["description"].endswith("(global ranks [0, 1])")
        assert out["timeout"] > 0
        assert out["peer_pids"] == out["pids"]  # learnt in the first call's settings check
        assert out["after_clear"] == (None, None)
        assert out["remade"] and out["ranks_again"] == [0, 1]
