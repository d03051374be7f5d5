"""MirroredStrategy when modules, optimizers and gradients change between and inside runs: whatever a user
or torch does to modules and optimizers between runs, training equals plain torch on one device with the
same global batch (float64, 1e-9); a replica's zero_grad, gradients of other dtypes, sparse gradients and
gradients some replicas lack are summed as one device accumulates them; nothing of a deleted model is kept.

Both ``zero_grad`` orders (before backward / after step) are covered by tests/test_conformance.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import torchstrategies as ts
from tests._mirrored_common import average_loss
from tests._mirrored_common import replica_id as _rid

B = 8  # global batch: 4 examples per replica
LR = 0.1


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[:-1](x)
        if "gain" in self._parameters:  # a parameter added between runs (plan test)
            h = h * self.gain
        return self.body[-1](h)


def _split(s: Any, *tensors: torch.Tensor) -> tuple[Any, ...]:
    """Each tensor's dim-0 chunk i for replica i."""
    n = s.num_replicas_in_sync
    return tuple(
        s.experimental_distribute_values_from_function(lambda c, t=t: t.chunk(n)[c.replica_id_in_sync_group])
        for t in tensors
    )


def _batch(step: int, width: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, width, generator=g, dtype=torch.float64)
    return x, torch.randn(B, 2, generator=g, dtype=torch.float64)


class _Trainer:
    """The same training code for plain torch (strategy None) and a strategy; SGD, zero_grad before
    backward (a replica without its own gradient slot would lose the other replica's gradient)."""

    def __init__(self, strategy: Any = None):
        self.strategy = strategy
        with self.scope():
            torch.manual_seed(0)
            self.model = _Net().double()
            self.opt = self.new_optimizer()

    def scope(self) -> Any:
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad()
        per_example = (self.model(x) - y).pow(2).sum(1)
        loss = average_loss(self.strategy, per_example, B)
        loss.backward()
        self.opt.step()

    def fit(self, steps: range) -> None:
        for k in steps:
            x, y = _batch(k)
            if self.strategy is None:
                self._step(x, y)
                continue
            self.strategy.run(self._step, args=_split(self.strategy, x, y))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _new_param(*shape: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(7)
    return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64))


def _replace_and_new_optimizer(t: _Trainer) -> None:
    t.model.body[0]._parameters["weight"] = _new_param(7, 5)
    with t.scope():
        t.opt = t.new_optimizer()


def _replace_in_optimizer_list(t: _Trainer) -> None:
    old = t.model.body[0].weight
    new = t.model.body[0]._parameters["weight"] = _new_param(7, 5)
    params = t.opt.param_groups[0]["params"]
    params[[id(p) for p in params].index(id(old))] = new  # the same list object, one element replaced


def _insert_and_new_optimizer(t: _Trainer) -> None:
    with t.scope():
        torch.manual_seed(3)
        t.model.body.insert(1, nn.Linear(7, 7).double())
        t.opt = t.new_optimizer()


def _append_and_new_optimizer(t: _Trainer) -> None:
    with t.scope():
        torch.manual_seed(3)
        t.model.body.append(nn.Linear(2, 2).double())  # (forward uses body[-1]: the new layer)
        t.opt = t.new_optimizer()


def _add_parameter_to_optimizer_list(t: _Trainer) -> None:
    with t.scope():
        t.model.gain = _new_param(7)
    t.opt.param_groups[0]["params"].append(t.model.gain)  # the cached plan's list, mutated in place


BETWEEN_RUNS = {
    "parameters_write_new_optimizer": _replace_and_new_optimizer,
    "parameters_write_replaced_in_optimizer_list": _replace_in_optimizer_list,
    "sequential_insert_new_optimizer": _insert_and_new_optimizer,
    "sequential_append_new_optimizer": _append_and_new_optimizer,
    "parameter_appended_to_optimizer_list": _add_parameter_to_optimizer_list,
}


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], before: dict) -> None:
    assert got.keys() == ref.keys()
    assert any(not torch.equal(ref[k], before[k]) for k in before if k in ref)  # training moved something
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("between", list(BETWEEN_RUNS))
def test_training_equals_one_device_when_the_model_or_optimizer_changes_between_runs(between):
    results = []
    for strategy in (None, ts.MirroredStrategy(num_replicas=2)):
        t = _Trainer(strategy)
        t.fit(range(2))
        before = t.state()
        BETWEEN_RUNS[between](t)
        t.fit(range(2, 5))
        results.append((t.state(), before))
    (ref, before), (got, _) = results
    _assert_same(got, ref, before)


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, momentum=0.3), nn.Tanh(), nn.Linear(5, 2))


def _emulated_mirrored_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, n: int) -> None:
    """What MirroredStrategy(n) computes, in plain torch: each replica a copy of the model on its slice,
    the SUM of their gradients applied once, buffers the MEAN of the replicas' (TF's ON_READ), integer
    buffers replica 0's."""
    copies = [copy.deepcopy(model) for _ in range(n)]
    for c, xc, yc in zip(copies, x.chunk(n), y.chunk(n), strict=True):
        ((c(xc) - yc).pow(2).sum(1).sum() / B).backward()
    opt.zero_grad()
    for p, *cps in zip(model.parameters(), *(c.parameters() for c in copies), strict=True):
        p.grad = cps[0].grad + cps[1].grad if n == 2 else sum(q.grad for q in cps)
    opt.step()
    with torch.no_grad():
        for name, b in model.named_buffers():
            parts = [dict(c.named_buffers())[name] for c in copies]
            b.copy_(torch.stack(parts).mean(0) if b.is_floating_point() else parts[0])


def test_training_with_batchnorm_after_model_double_keeps_each_replica_its_own_buffers():
    torch.manual_seed(0)
    ref = _bn_net()
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        torch.manual_seed(0)
        model = _bn_net()
    x0 = torch.randn(B, 4)
    ref.eval()
    model.eval()
    s.run(model, args=(x0,))  # the replicas' slots now hold the float32 buffers
    for m in (ref, model):
        m.train()
        m.double()  # new buffer tensors written into _buffers
    with s.scope():
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        ts.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=B).backward()
        opt.step()

    before = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    for k in range(3):
        x, y = _batch(k, 4)
        _emulated_mirrored_step(ref, ref_opt, x, y, 2)
        s.run(step, args=_split(s, x, y))
    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    assert got["1.running_mean"].dtype == torch.float64
    _assert_same(got, ref_state, before)


def test_a_deleted_model_and_optimizer_are_not_kept_by_the_strategy():
    t = _Trainer(ts.MirroredStrategy(num_replicas=2))
    t.fit(range(2))
    s = t.strategy
    param_ref, opt_ref = weakref.ref(t.model.body[0].weight), weakref.ref(t.opt)
    del t.model, t.opt
    gc.collect()
    assert param_ref() is None and opt_ref() is None
    t2 = _Trainer(s)  # the strategy goes on with another model
    t2.fit(range(1))
    w = t2.model.body[0].weight
    comps = s.extended.replica_components(w)
    assert comps[0] is w and comps[1] is not w and torch.equal(comps[1], w.detach())


def test_a_replaced_parameter_is_not_held_by_the_strategy():
    t = _Trainer(ts.MirroredStrategy(num_replicas=2))
    with t.scope():
        t.opt = torch.optim.SGD(t.model.parameters(), lr=LR)  # no state keyed by the old parameter
    t.fit(range(2))
    old_ref = weakref.ref(t.model.body[0].weight)
    _replace_in_optimizer_list(t)  # the optimizer lives on, without the old parameter
    assert old_ref() is None  # (no cycle either: it died with its last reference)
    t.fit(range(2, 3))


def test_a_deleted_model_gradients_are_released_once_the_strategy_runs_another_model():
    t = _Trainer(ts.MirroredStrategy(num_replicas=2))
    t.fit(range(2))
    s = t.strategy
    grad_ref = weakref.ref(t.model.body[0].weight.grad)
    del t.model, t.opt
    t2 = _Trainer(s)
    t2.fit(range(1))  # the replicated set is rebuilt without the deleted model
    gc.collect()
    assert grad_ref() is None


# -- a replica's zero_grad -------------------------------------------------------------------------
def _lin_and_sgd(s: Any, cls: type = torch.optim.SGD) -> tuple[nn.Linear, torch.optim.Optimizer]:
    with s.scope():
        lin = nn.Linear(3, 1).double()
        opt = cls(lin.parameters(), lr=1.0)
    return lin, opt


def _x() -> torch.Tensor:
    return torch.full((2, 3), float(_rid() + 1), dtype=torch.float64)


def test_replica_zero_grad_sets_only_that_replicas_gradients_to_none():
    s = ts.MirroredStrategy(num_replicas=2)
    lin, opt = _lin_and_sgd(s)
    w0 = lin.weight.detach().clone()
    seen: dict[int, tuple[bool, list[bool]]] = {}

    def fn():
        lin(_x()).sum().backward()
        had = all(p.grad is not None for p in lin.parameters())
        if _rid() == 0:
            opt.zero_grad()
        seen[_rid()] = had, [p.grad is None for p in lin.parameters()]

    s.run(fn)
    assert seen == {0: (True, [True, True]), 1: (True, [False, False])}
    opt.step()  # cross-replica: replica 1 still holds the global gradient backward gave it (2 + 4)
    torch.testing.assert_close(lin.weight.detach(), w0 - torch.full((1, 3), 6.0, dtype=torch.float64))


def test_replica_zero_grad_after_backward_leaves_nothing_for_the_next_step():
    s = ts.MirroredStrategy(num_replicas=2)
    lin, opt = _lin_and_sgd(s)
    w0 = lin.weight.detach().clone()
    seen: dict[int, list[bool]] = {}

    def stale():
        lin(_x()).sum().backward()
        opt.zero_grad()
        seen[_rid()] = [p.grad is None for p in lin.parameters()]

    def fresh():
        lin(_x()).sum().backward()
        opt.step()

    s.run(stale)
    assert seen == {0: [True, True], 1: [True, True]}
    s.run(fresh)
    # only the second run's gradients: 2 rows of 1.0 (replica 0) and of 2.0 (replica 1)
    torch.testing.assert_close(lin.weight.detach(), w0 - (2 * 1.0 + 2 * 2.0))


def test_replica_zero_grad_set_to_none_false_zeroes_the_gradients_in_place():
    s = ts.MirroredStrategy(num_replicas=2)
    lin, opt = _lin_and_sgd(s)
    seen: dict[int, list[bool]] = {}

    def fn():
        lin(_x()).sum().backward()
        grads = [p.grad for p in lin.parameters()]
        assert all(bool((g != 0).all()) for g in grads)
        opt.zero_grad(set_to_none=False)
        seen[_rid()] = [
            p.grad is g and not bool(g.any()) for p, g in zip(lin.parameters(), grads, strict=True)
        ]

    s.run(fn)
    assert seen == {0: [True, True], 1: [True, True]}


@pytest.mark.parametrize("profiler", ["torch.profiler", "autograd.profiler"])
def test_replica_zero_grad_is_recorded_while_a_profiler_runs(profiler):
    s = ts.MirroredStrategy(num_replicas=2)
    lin, opt = _lin_and_sgd(s)
    seen: dict[int, list[bool]] = {}

    def fn():
        lin(_x()).sum().backward()
        opt.zero_grad()
        seen[_rid()] = [p.grad is None for p in lin.parameters()]
        opt.step()  # (the function's last statement: every replica runs in the calling, profiled thread)

    s.run(fn)  # warm: the fast path has run
    if profiler == "torch.profiler":
        prof_cm: Any = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    else:
        prof_cm = torch.autograd.profiler.profile()
    seen.clear()
    with prof_cm as prof:
        s.run(fn)
    events = prof.events() if callable(getattr(prof, "events", None)) else prof.function_events
    names = [e.name for e in events]
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 2  # one per replica
    assert seen == {0: [True, True], 1: [True, True]}


def test_an_optimizer_overriding_zero_grad_has_its_override_called_in_every_replica():
    calls: list[tuple[int, bool]] = []

    class CountingSGD(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append((_rid(), set_to_none))
            super().zero_grad(set_to_none)

    s = ts.MirroredStrategy(num_replicas=2)
    lin, opt = _lin_and_sgd(s, CountingSGD)
    seen: dict[int, list[bool]] = {}

    def fn():
        lin(_x()).sum().backward()
        opt.zero_grad()
        seen[_rid()] = [p.grad is None for p in lin.parameters()]

    s.run(fn)
    assert calls == [(0, True), (1, True)]
    assert seen == {0: [True, True], 1: [True, True]}


# -- the gradient sum: other dtypes, sparse gradients, a replica without a gradient -------------------
def _replica_grads_then_step(s: Any, params: list, opt: torch.optim.Optimizer, loss_fn) -> list:
    """Runs zero_grad, backward, step in each replica; returns each replica's gradients (before the step)."""

    def fn():
        opt.zero_grad()
        loss_fn().backward()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        opt.step()
        return grads

    return list(s.experimental_local_results(s.run(fn)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_gradients_are_summed(dtype):
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        torch.manual_seed(0)
        lin = nn.Linear(4, 3).to(dtype)
        opt = torch.optim.SGD(lin.parameters(), lr=LR)
    w0 = [p.detach().clone() for p in lin.parameters()]
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(2, 2, 4, generator=g).to(dtype)
    plain = copy.deepcopy(lin)  # (outside the scope: a plain module) each replica's own gradient
    local = [torch.autograd.grad(plain(xs[k]).float().pow(2).sum(), list(plain.parameters())) for k in range(2)]
    per_replica = _replica_grads_then_step(
        s, list(lin.parameters()), opt, lambda: lin(xs[_rid()]).float().pow(2).sum()
    )
    for p, p0, g0, g1, l0, l1 in zip(lin.parameters(), w0, *per_replica, *local, strict=True):
        assert g0.dtype == dtype and torch.equal(g0, g1)  # after backward every replica holds the sum
        total = (l0.float() + l1.float()).to(dtype)
        assert torch.equal(p.grad, total) and torch.equal(g0, total)  # the replicas' sum
        assert torch.equal(p.detach(), p0.add(total, alpha=-LR))


def test_sparse_embedding_gradients_are_summed_like_one_device():
    idx = torch.tensor([[1, 3, 3, 7], [3, 0, 7, 9]])  # overlapping rows between the replicas
    results = []
    for s in (None, ts.MirroredStrategy(num_replicas=2)):
        with s.scope() if s is not None else contextlib.nullcontext():
            torch.manual_seed(0)
            emb = nn.Embedding(10, 3, sparse=True).double()
            opt = torch.optim.SGD(emb.parameters(), lr=LR)
        if s is None:
            for _ in range(2):
                opt.zero_grad()
                emb(idx.reshape(-1)).pow(2).sum().backward()
                opt.step()
            results.append(emb.weight.detach().clone())
            continue
        w0 = emb.weight.detach().clone()
        per_replica = _replica_grads_then_step(s, [emb.weight], opt, lambda: emb(idx[_rid()]).pow(2).sum())
        (g0,), (g1,) = per_replica
        assert g0.is_sparse and g1.is_sparse
        total = g0.to_dense()  # after backward every replica holds the sum
        torch.testing.assert_close(g1.to_dense(), total, rtol=0, atol=0)
        ref = torch.zeros_like(total)
        ref.index_add_(0, idx.reshape(-1), 2 * w0[idx.reshape(-1)])
        torch.testing.assert_close(total, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(emb.weight.grad.to_dense(), total, rtol=0, atol=1e-12)
        torch.testing.assert_close(emb.weight.detach(), w0 - LR * total, rtol=0, atol=1e-12)
        _replica_grads_then_step(s, [emb.weight], opt, lambda: emb(idx[_rid()]).pow(2).sum())
        results.append(emb.weight.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-12)


def test_a_parameter_without_gradient_on_one_replica_gets_the_other_replicas_gradient():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        torch.manual_seed(0)
        a, b = nn.Linear(3, 1).double(), nn.Linear(3, 1).double()
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=LR)
    params = [*a.parameters(), *b.parameters()]

    def loss():
        x = _x()
        return a(x).sum() + (b(x).sum() if _rid() == 1 else 0)  # replica 0 never uses b

    for _ in range(2):  # the second step on the cached plan
        w0 = [p.detach().clone() for p in params]
        (aw0, ab0, bw0, bb0), (aw1, ab1, bw1, bb1) = _replica_grads_then_step(s, params, opt, loss)
        assert bw0 is not None and torch.equal(bw0, bw1)  # replica 0 too holds the sum after backward
        for p, p0, total in zip(params, w0, [aw0, ab0, bw0, bb0], strict=True):
            torch.testing.assert_close(p.detach(), p0 - LR * total, rtol=0, atol=1e-12)


def test_cross_replica_steps_with_the_optimizer_list_mutated_between_them_equal_one_device():
    """No run between the two steps (nothing refreshes the replicated set): the cached plan of the mutated
    list must still be rebuilt, so the parameter appended gets its replicas' gradients."""
    results = []
    for s in (None, ts.MirroredStrategy(num_replicas=2)):
        t = _Trainer(s)
        first, second = t.model.body[0], t.model.body[2]
        with t.scope():
            t.opt = torch.optim.SGD(first.parameters(), lr=LR)
        x, y = _batch(0)

        def backward(x, y, t=t):
            per_example = (t.model(x) - y).pow(2).sum(1)
            if t.strategy is None:
                (per_example.sum() / B).backward()
            else:
                ts.compute_average_loss(per_example, global_batch_size=B).backward()

        before = t.state()
        if s is None:
            backward(x, y)
        else:
            s.run(backward, args=_split(s, x, y))
        t.opt.step()  # cross-replica: the plan of this list is cached
        t.opt.param_groups[0]["params"].append(second.weight)
        t.opt.step()  # first's weight and bias once more (the same sum), second's weight once
        results.append((t.state(), before))
    (ref, before), (got, _) = results
    assert not torch.equal(ref["body.2.weight"], before["body.2.weight"])
    assert torch.equal(ref["body.2.bias"], before["body.2.bias"])
    _assert_same(got, ref, before)


def test_a_new_parameter_at_a_dead_parameters_address_does_not_get_its_gradient():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        lin = nn.Linear(1, 1, bias=False)
        temporary = nn.Linear(1, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    with torch.no_grad():
        lin.weight.zero_()
    s.run(lambda: lin(torch.full((1, 1), float(_rid() + 1))).sum().backward())
    opt.step()  # cross-replica: 1 + 2, and the plan of opt's list is cached
    assert float(lin.weight.detach()) == -3.0
    params = opt.param_groups[0]["params"]
    old_id = id(params[0])
    del temporary  # an unrelated in-scope module dies: the watch forgets the tensors it held
    gc.collect()
    data = torch.zeros(1, 1)
    lin._parameters["weight"] = params[0] = None  # the old parameter dies (nothing else holds it)
    tried = [nn.Parameter(data)]  # until the allocator hands out the dead one's address again
    while id(tried[-1]) != old_id and len(tried) < 5000:
        tried.append(nn.Parameter(data))
    new = tried.pop()
    if id(new) != old_id:
        pytest.skip("no new parameter took the dead one's address")
    del tried
    lin._parameters["weight"] = params[0] = new
    new.grad = torch.full((1, 1), 10.0)  # e.g. a backward in cross-replica context
    opt.step()  # no run since: `new` is not replicated (yet), its own gradient applies as on one device
    assert float(new.detach()) == -10.0
