"""Gradients kept across steps: zero_grad every 2nd step, or never (gradient accumulation).

Each strategy must train like one device that keeps its gradients the same way: the gradient a step applies
is the sum of the global gradients since the last zero_grad, counted once each (through the public API only).
"""

from __future__ import annotations

import functools

import pytest
import torch

import torchstrategies as ts
from tests._mw_common import IN, OUT, assert_params_close, make_model, shard
from tests.harness import run_ranks

STEPS = 4
GLOBAL_BATCH = 12
LR = 0.05
PATTERNS = {"every_2nd": lambda s: s % 2 == 0, "never": lambda s: s == 0}  # zero_grad before step s?


def _data(steps: int = STEPS, global_batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(steps, global_batch, IN, generator=g, dtype=torch.float64)
    ys = torch.randn(steps, global_batch, OUT, generator=g, dtype=torch.float64)
    return xs, ys


def _loss(model, x, y):
    return ((model(x) - y) ** 2).sum() / GLOBAL_BATCH


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.5)


def _step(model, opt, x, y, zero: bool):
    """One training step, after a zero_grad when the pattern says so for this step (``zero``)."""
    if zero:
        opt.zero_grad()
    loss = _loss(model, x, y)
    loss.backward()
    opt.step()
    return loss


def _reference(pattern: str) -> list[torch.Tensor]:
    model = make_model(0).double()
    opt = _optimizer(model.parameters())
    xs, ys = _data()
    for s in range(STEPS):
        _step(model, opt, xs[s], ys[s], PATTERNS[pattern](s))
    return [p.detach().clone() for p in model.parameters()]


def _train_in_process(strategy, pattern: str) -> list[torch.Tensor]:
    with strategy.scope():
        model = make_model(0).double()
        opt = _optimizer(model.parameters())
    xs, ys = _data()
    step = functools.partial(_step, model, opt)
    batches = list(zip(xs, ys, strict=True))
    for s, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        strategy.run(step, args=(x, y, PATTERNS[pattern](s)))
    return [p.detach().clone() for p in model.parameters()]


def _check(got, pattern: str, what: str = "") -> None:
    want = _reference(pattern)
    init = [p.detach().double() for p in make_model(0).parameters()]
    assert any(not torch.allclose(w, i) for w, i in zip(want, init, strict=True))  # training moved them
    assert_params_close(got, want, rtol=1e-6, atol=1e-9, what=f"{pattern} {what}")


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("replicas", [2, 3])
def test_mirrored_keeps_gradients_across_steps_like_one_device(pattern, replicas):
    _check(_train_in_process(ts.MirroredStrategy(num_replicas=replicas), pattern), pattern)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_central_storage_keeps_gradients_across_steps_like_one_device(pattern):
    s = ts.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"], parameter_device="cpu")
    _check(_train_in_process(s, pattern), pattern)


def _mwms_body(rank, world):
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    out = {}
    for pattern, zero in PATTERNS.items():
        strategy = MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = make_model(rank).double()  # rank 0's values reach every rank through the broadcast
            opt = _optimizer(model.parameters())
        xs, ys = _data()
        step = functools.partial(_step, model, opt)
        for s in range(STEPS):
            strategy.run(step, args=(shard(xs[s], rank, world), shard(ys[s], rank, world), zero(s)))
        out[pattern] = [p.detach().clone().numpy() for p in model.parameters()]
        strategy.shutdown()
    return out


@pytest.mark.timeout(120)
def test_multi_worker_mirrored_keeps_gradients_across_steps_like_one_device():
    results = run_ranks(_mwms_body, 2, timeout=110)
    for rank, res in enumerate(results):
        for pattern in PATTERNS:
            _check(res[pattern], pattern, f"rank {rank}")
