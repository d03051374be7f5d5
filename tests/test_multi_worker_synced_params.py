"""MultiWorkerMirroredStrategy remembers the tensors it synced by identity that dies with them (issue 26).

Remembering them by ``id()`` failed once a frozen module was freed and a new module's parameter was allocated
at the same address: the new parameter was taken for synced, so it was neither broadcast nor given a
gradient synchronizer (a broadcast mismatch when one rank reused the address, silent local-gradient
training when both did). Here every round frees a frozen module and builds a new model in its place; every
rank must end every round with identical parameters, equal to one device's training on the global batch.
"""

from __future__ import annotations

import pytest
import torch

from tests._mw_common import IN, LR, OUT, assert_params_close, make_data, params_of, shard
from tests.harness import run_ranks

ROUNDS = 6
GLOBAL_BATCH = 12


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH


def _body(rank, world):
    import gc

    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy()
    xs, ys = make_data(steps=ROUNDS, global_batch=GLOBAL_BATCH)
    rounds = []
    for k in range(ROUNDS):
        with s.scope():
            frozen = torch.nn.Linear(IN, OUT)
            frozen.requires_grad_(False)
        del frozen  # its parameters are freed here; the next ones are likely allocated at their addresses
        with s.scope():
            torch.manual_seed(100 * k + rank)  # a different start on every rank: the broadcast must fix it
            model = torch.nn.Linear(IN, OUT)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(2):
            _loss(model, shard(xs[k], rank, world), shard(ys[k], rank, world)).backward()
            opt.step()
            opt.zero_grad()
        rounds.append(params_of(model))
    del model, opt
    gc.collect()
    live = len(s.extended.gradient_synchronizers)  # the dropped models' synchronizers went with them
    s.shutdown()
    return {"rounds": rounds, "live_synchronizers": live}


def _one_device(k):
    torch.manual_seed(100 * k)  # rank 0's start
    model = torch.nn.Linear(IN, OUT).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = make_data(steps=ROUNDS, global_batch=GLOBAL_BATCH)
    for _ in range(2):
        _loss(model, xs[k].double(), ys[k]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_models_built_where_freed_frozen_modules_were_train_in_sync_like_one_device():
    results = run_ranks(_body, 2, timeout=110)
    for k in range(ROUNDS):
        want = _one_device(k)
        for rank, r in enumerate(results):
            assert_params_close(r["rounds"][k], want, what=f"round {k} rank {rank}")
            for p, q in zip(r["rounds"][k], results[0]["rounds"][k]):
                assert (p == q).all(), f"round {k}: rank {rank} differs from rank 0"
    for r in results:
        assert r["live_synchronizers"] == 0
