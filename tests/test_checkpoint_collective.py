"""Issue 50: which workers a checkpoint talks through, and how it gathers per-rank bytes.

* The MultiWorkerMirroredStrategy is taken from the caller (``Checkpoint(strategy=...)`` or the scope that is
  current), never picked from the process's live strategies when two are alive: that is a named error.
* ``gather_per_rank`` is a real all-gather (the lengths, then the padded bytes), not a SUM all-reduce of
  int32 rows, and gives every rank every rank's bytes in rank order.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks


def _two_strategies_body(rank, world, directory):
    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint
    from torchstrategies.checkpoint import read_state as read_file
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s1, s2 = MultiWorkerMirroredStrategy(), MultiWorkerMirroredStrategy()
    calls: list[str] = []
    for name, s in (("s1", s1), ("s2", s2)):
        barrier = s.extended.barrier
        s.extended.barrier = lambda name=name, barrier=barrier: (calls.append(name), barrier())[1]
    with s1.scope():
        model = torch.nn.Module()
        model.register_buffer("stat", torch.zeros(3))
    ts.declare_buffer_aggregation(model, "stat", "mean")
    model.stat.fill_(float(rank))  # differs per worker: saved as the mean
    out: dict = {}

    def save(ckpt, name):
        calls.clear()
        try:
            ckpt.save(os.path.join(directory, name))
        except ValueError as e:
            return f"ValueError: {e}"
        return list(calls)

    out["ambiguous"] = save(Checkpoint(model=model), "none.pt")
    out["argument"] = save(Checkpoint(model=model, strategy=s2), "arg.pt")
    with s2.scope():
        out["scope_s2"] = save(Checkpoint(model=model), "scope2.pt")
    with s1.scope():
        out["scope_s1"] = save(Checkpoint(model=model), "scope1.pt")
    out["saved"] = read_file(os.path.join(directory, "arg.pt"))["objects"]["model"]["state"]["stat"].tolist()
    s2.shutdown()
    out["shut_down"] = save(Checkpoint(model=model, strategy=s2), "shut.pt")
    out["one_live"] = save(Checkpoint(model=model), "one.pt")
    s1.shutdown()
    return out


@pytest.mark.timeout(120)
def test_checkpoint_takes_its_strategy_from_the_caller_with_two_strategies_alive(tmp_path):
    for r in run_ranks(_two_strategies_body, 2, args=(str(tmp_path),), timeout=100):
        assert r["ambiguous"].startswith("ValueError: Checkpoint save to")
        assert "2 MultiWorkerMirroredStrategy instances are live" in r["ambiguous"]
        assert "strategy=s" in r["ambiguous"]
        assert r["argument"] == ["s2"]
        assert r["scope_s2"] == ["s2"]
        assert r["scope_s1"] == ["s1"]
        assert r["saved"] == [0.5, 0.5, 0.5]  # a collective save: the buffer's mean over both workers
        assert r["shut_down"].startswith("ValueError") and "was shut down" in r["shut_down"]
        assert r["one_live"] == ["s1"]
    assert not os.path.exists(tmp_path / "none.pt")


def _gather_body(rank, world):
    import torch.distributed as dist

    from torchstrategies._checkpoint_state import gather_per_rank
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy()
    used: list[str] = []
    for name in ("all_reduce", "all_gather_single", "all_gather"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, _f=real, **k: (used.append(_n), _f(*a, **k))[1])
    blobs = [b"", bytes(range(256)) * 3 + b"\x00\xff", b"x"]  # empty, long with 0 and 255 bytes, one byte
    out = {"gathered": [gather_per_rank(s.extended, blobs[(rank + i) % 3]) for i in range(3)], "used": used}
    s.shutdown()
    return out


@pytest.mark.timeout(90)
def test_gather_per_rank_all_gathers_every_ranks_bytes_in_rank_order(tmp_path):
    blobs = [b"", bytes(range(256)) * 3 + b"\x00\xff", b"x"]
    for r in run_ranks(_gather_body, 2, timeout=80):
        assert r["gathered"] == [[blobs[i % 3], blobs[(i + 1) % 3]] for i in range(3)]
        assert r["used"] == ["all_gather_single"] * 6  # per call: the lengths, then the padded bytes
