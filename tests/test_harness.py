"""The multi-process harness itself: results in rank order, errors and hangs become failures."""

from __future__ import annotations

import socket
import time

import harness
import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, Rendezvous, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _hang(rank, world_size):
    time.sleep(3600)


def test_harness_returns_results_in_rank_order():
    assert run_ranks(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_harness_reports_a_rank_exception():
    with pytest.raises(RankFailure, match="boom from rank 1"):
        run_ranks(_raise_on_one, 2, init_process_group=False)


def test_harness_kills_hung_ranks_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] of 2 did not finish"):
        run_ranks(_hang, 2, timeout=3, init_process_group=False)
    assert time.monotonic() - start < 30


def test_a_port_another_process_took_does_not_break_the_rendezvous(monkeypatch):
    """Issue 52: a port picked free and bound later can be taken by another process in between (a TCPStore
    "Connection reset by peer", then a hang). The store binds port 0 itself, so a squatter on whatever port
    free_port() would pick changes nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        monkeypatch.setattr(harness, "free_port", lambda: squatter.getsockname()[1])
        assert run_ranks(_sum_ranks, 2, timeout=60, pg_timeout=20) == [1.0, 1.0]


def _master_port(rank, world_size):
    dist.barrier()
    return int(__import__("os").environ["MASTER_PORT"])


def test_the_ranks_meet_at_the_rendezvous_store_the_test_hosts():
    with Rendezvous() as rdzv:
        before = rdzv.store.num_keys()
        assert run_ranks(_master_port, 2, rendezvous=rdzv, timeout=60, pg_timeout=20) == [rdzv.port] * 2
        assert rdzv.store.num_keys() > before  # the process group's rendezvous wrote its keys there
