"""Every shape of replica function around ``optimizer.step()`` under MirroredStrategy trains like plain torch
on one device (float64, same global batch, 1e-9), returns the right results, and runs on the one schedule
(replica 0 in the calling thread, each other replica on a thread of its own); parameter subclasses,
non-contiguous parameters and create_graph gradients too."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchstrategies as ts
from tests._mirrored_common import average_loss

B = 6  # global batch: 3 or 2 examples per replica
LR = 0.1
F64 = torch.float64


class _Sub(torch.Tensor):
    """A tensor subclass (not a Parameter)."""


class _TaggedParameter(nn.Parameter):
    """A Parameter subclass: not exactly Parameter either."""


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, generator=g, dtype=F64), torch.randn(B, 2, generator=g, dtype=F64)


def _split(s: Any, *tensors: torch.Tensor) -> tuple[Any, ...]:
    n = s.num_replicas_in_sync
    return tuple(
        s.experimental_distribute_values_from_function(lambda c, t=t: t.chunk(n)[c.replica_id_in_sync_group])
        for t in tensors
    )


def _plain_model(param: str = "plain") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
    w = model[0].weight.detach()
    if param == "parameter_subclass":
        model[0].weight = _TaggedParameter(w.clone())
    elif param == "tensor_subclass":  # not registered as a parameter: the optimizer gets it (_Training)
        del model[0].weight
        model[0].weight = torch.Tensor._make_subclass(_Sub, w.clone(), True)
    elif param == "transposed":  # a non-contiguous parameter: torch gives it gradients of its own strides
        model[0].weight = nn.Parameter(w.t().contiguous().t())
        assert not model[0].weight.is_contiguous()
    return model


class _Training:
    """A model and SGD (momentum) made in the strategy's scope (plain torch when strategy is None)."""

    def __init__(self, strategy: Any = None, param: str = "plain", create_graph: bool = False):
        self.strategy = strategy
        self.create_graph = create_graph
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.model = _plain_model(param)
            self.tensors = list(self.model.parameters())
            if param == "tensor_subclass":
                self.tensors.insert(0, self.model[0].weight)
            self.opt = torch.optim.SGD(self.tensors, lr=LR, momentum=0.9)
        self.threads: list[tuple[int, threading.Thread]] = []  # (replica, thread) as each replica starts
        self.finally_ran = 0

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.strategy is not None:
            self.threads.append(
                (ts.get_replica_context().replica_id_in_sync_group, threading.current_thread())
            )
        self.opt.zero_grad()
        per_example = (self.model(x) - y).pow(2).sum(1)
        loss = average_loss(self.strategy, per_example, B)
        loss.backward(create_graph=self.create_graph)
        return loss

    def method(self, x: torch.Tensor, y: torch.Tensor) -> None:  # a bound method as the replica function
        self.backward(x, y)
        self.opt.step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().as_subclass(torch.Tensor).clone() for p in self.tensors]


def _fns(t: _Training) -> dict[str, Callable[..., Any]]:
    """Replica functions that step, each a different shape around ``optimizer.step()``."""
    opt, model = t.opt, t.model

    def step_last(x, y):
        t.backward(x, y)
        opt.step()

    def return_loss(x, y):
        loss = t.backward(x, y)
        opt.step()
        return loss

    def return_loss_detach(x, y):
        loss = t.backward(x, y)
        opt.step()
        return loss.detach()

    def read_params_after(x, y):
        t.backward(x, y)
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    def read_grads_after(x, y):
        t.backward(x, y)
        opt.step()
        return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    def try_finally(x, y):
        t.backward(x, y)
        try:
            opt.step()
        finally:
            t.finally_ran += 1

    def partial_target(scale, x, y):
        t.backward(x * scale, y)
        opt.step()

    return {
        "step_last": step_last,
        "return_loss": return_loss,
        "return_loss_detach": return_loss_detach,
        "read_params_after": read_params_after,
        "read_grads_after": read_grads_after,
        "try_finally": try_finally,
        "bound_method": t.method,
        "partial": functools.partial(partial_target, 1.0),
    }


VARIANTS = [
    "step_last",
    "return_loss",
    "return_loss_detach",
    "read_params_after",
    "read_grads_after",
    "try_finally",
    "bound_method",
    "partial",
]
STEPS = 3


def _one_device() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list[torch.Tensor], list]:
    """Plain torch: the parameters after each step, the gradients of each step, each replica's share of
    each step's loss (for n = 2 and 3), all computed before the step."""
    t = _Training()
    params, grads, losses = [], [], []
    for k in range(STEPS):
        x, y = _batch(k)
        with torch.no_grad():
            per_example = (t.model(x) - y).pow(2).sum(1)
            losses.append({n: [c.sum() / B for c in per_example.chunk(n)] for n in (2, 3)})
        t.backward(x, y)
        grads.append([p.grad.detach().clone() for p in t.model.parameters()])
        t.opt.step()
        params.append(t.params())
    return params, grads, t.params(), losses


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def _train(
    n: int, variant: str, strategy_setup: Callable[[Any], None] | None = None
) -> tuple[_Training, list]:
    s = ts.MirroredStrategy(num_replicas=n)
    if strategy_setup is not None:
        strategy_setup(s)
    t = _Training(s)
    fn = _fns(t)[variant]
    assert list(_fns(t)) == VARIANTS
    results = []
    for k in range(STEPS):
        out = s.run(fn, args=_split(s, *_batch(k)))
        results.append(None if out is None else s.experimental_local_results(out))
    return t, results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_shape_of_replica_function_trains_like_one_device(variant, n):
    ref_params, ref_grads, ref_final, ref_losses = _one_device()
    t, results = _train(n, variant)
    for got, want in zip(t.params(), ref_final, strict=True):
        _close(got, want)
    me = threading.current_thread()
    assert [r for r, _ in t.threads] == list(range(n)) * STEPS
    assert all(th is me for r, th in t.threads if r == 0)
    assert len({th for r, th in t.threads if r > 0}) == n - 1 and me not in {th for _, th in t.threads[1:n]}
    for k, per_replica in enumerate(results):
        if per_replica is None:  # (what run returns when every replica returned None)
            assert variant not in (
                "return_loss",
                "return_loss_detach",
                "read_params_after",
                "read_grads_after",
            )
            continue
        assert len(per_replica) == n
        if variant in ("return_loss", "return_loss_detach"):
            for got, want in zip(per_replica, ref_losses[k][n], strict=True):
                assert isinstance(got, torch.Tensor) and got.requires_grad == (variant == "return_loss")
                _close(got.detach(), want)
        elif variant == "read_params_after":  # every replica sees the stepped parameters
            for got in per_replica:
                for g, w in zip(got, ref_params[k], strict=True):
                    _close(g, w)
        elif variant == "read_grads_after":  # every replica starts from the sum (issue 35's rule)
            for got in per_replica:
                for g, w in zip(got, ref_grads[k], strict=True):
                    _close(g, w)
        else:
            raise AssertionError(per_replica)
    assert t.finally_ran == (n * STEPS if variant == "try_finally" else 0)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["tensor_subclass", "parameter_subclass", "transposed", "create_graph"])
def test_subclassed_non_contiguous_and_create_graph_parameters_train_like_one_device(kind, n):
    """A tensor subclass and a Parameter subclass, a non-contiguous parameter (so are its gradients) and
    create_graph gradients (they require grad)."""
    param = kind if kind != "create_graph" else "plain"
    final = []
    for strategy in (None, ts.MirroredStrategy(num_replicas=n)):
        t = _Training(strategy, param=param, create_graph=kind == "create_graph")
        before = t.params()
        for k in range(STEPS):
            if strategy is None:
                t.method(*_batch(k))
            else:
                strategy.run(t.method, args=_split(strategy, *_batch(k)))
        if kind in ("tensor_subclass", "parameter_subclass"):
            assert type(t.model[0].weight) is (_Sub if kind == "tensor_subclass" else _TaggedParameter)
            assert t.model[0].weight is t.opt.param_groups[0]["params"][0]  # (optimized, first)
        if kind == "transposed":
            assert not t.model[0].weight.grad.is_contiguous()
        if kind == "create_graph":
            assert t.model[0].weight.grad.requires_grad
        final.append(t.params())
    assert any(not torch.equal(a, b) for a, b in zip(final[0], before, strict=True))
    for got, want in zip(final[1], final[0], strict=True):
        _close(got, want)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["clone", "item", "view_clone"])
def test_returning_a_read_of_a_stepped_parameter_after_the_step_sees_the_update(method):
    """``return w.clone()`` / ``w.item()`` after ``optimizer.step()`` where the local ``w`` is a parameter the
    step updates (or a view of one, taken before the step): every replica reads the updated value."""
    out = []
    for timeout in (None, 30.0):
        s = ts.MirroredStrategy(num_replicas=2)
        s.extended.merge_call_timeout = timeout
        with s.scope():
            lin = nn.Linear(1, 1, bias=False).double()
            opt = torch.optim.SGD(lin.parameters(), lr=1.0)
        with torch.no_grad():
            lin.weight.zero_()

        def clone(lin=lin, opt=opt):
            w = lin.weight
            lin(torch.ones(1, 1, dtype=F64)).sum().backward()
            opt.step()
            return w.clone()

        def item(lin=lin, opt=opt):
            w = lin.weight
            lin(torch.ones(1, 1, dtype=F64)).sum().backward()
            opt.step()
            return w.item()

        def view_clone(lin=lin, opt=opt):
            w = lin.weight[0]  # a view (with a grad_fn) of the parameter
            lin(torch.ones(1, 1, dtype=F64)).sum().backward()
            opt.step()
            return w.clone()

        fn = {"clone": clone, "item": item, "view_clone": view_clone}[method]
        results = s.experimental_local_results(s.run(fn))
        out.append([v if isinstance(v, float) else float(v.detach()) for v in results])
    assert out[1] == [-2.0, -2.0]  # the sum of the replicas' gradients (1 + 1), applied once
    assert out[0] == out[1]
