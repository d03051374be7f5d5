"""MirroredStrategy's per-replica bookkeeping in C (csrc/cpu/replica_grads.cpp, csrc/cpu/frame_check.cpp):
``_C.swap_gradients``, ``_C.clear_gradients``, ``_C.sum_replica_gradients`` called directly on small slot
objects (each either does exactly what its docstring says, or answers "not mine" with nothing changed),
and ``_C.FrameCheck`` through MirroredStrategy: every replica-function shape trains like plain torch on one
device (float64, same global batch, 1e-9), returns the right results, on the documented schedule, and bit
for bit like the same training with every C path replaced by its Python fallback.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchstrategies as ts
from torchstrategies._ext import _C
from torchstrategies.distribute import mirrored_run, replicated
from torchstrategies.distribute.replicated import ReplicaSlot
from torchstrategies.strategies import mirrored

B = 6  # global batch: 3 or 2 examples per replica
LR = 0.1
F64 = torch.float64
CPU = torch.device("cpu")


class _Sub(torch.Tensor):
    """A tensor subclass (not a Parameter): the C paths leave it to Python."""


class _TaggedParameter(nn.Parameter):
    """A Parameter subclass: not exactly Parameter either."""


def _rand(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _slot(p: torch.Tensor, grads: list, home: Any = None, is_param: bool = True) -> ReplicaSlot:
    s = ReplicaSlot(p, is_param, len(grads))
    s.grads = list(grads)
    s.home_grad = home
    return s


def _snapshot(slots: list[ReplicaSlot]) -> list[Any]:
    """What a swap could change, by identity: each parameter's .grad, the grads list and its items, home_grad."""
    out = []
    for s in slots:
        t = s.ref()
        out.append([None if t is None else t.grad, s.grads, *s.grads, s.home_grad])
    return out


def _assert_unchanged(before: list[Any], slots: list[ReplicaSlot]) -> None:
    after = _snapshot(slots)
    for b, a in zip(before, after, strict=True):
        assert len(b) == len(a) and all(x is y for x, y in zip(b, a, strict=True))


# -- _C.swap_gradients -------------------------------------------------------------------------------
def test_swap_gradients_moves_each_gradient_to_the_documented_place():
    """activate(1) (save -1, load 1), hand_over 1 -> 2, deactivate(2) (save 2, load -1) over a Parameter and
    a plain tensor; every gradient is a distinct object, so any wrong index fails an identity check."""
    n = 3
    params = [nn.Parameter(_rand(2, 3, seed=1)), _rand(3, seed=2).requires_grad_()]
    grads = [[_rand(*p.shape, seed=10 * k + j) for j in range(n)] for k, p in enumerate(params)]
    grads[1][2] = None  # replica 2 has no gradient yet for the second tensor
    primary = [_rand(*p.shape, seed=99 + k) for k, p in enumerate(params)]
    for p, g in zip(params, primary, strict=True):
        p.grad = g
    slots = [_slot(p, g) for p, g in zip(params, grads, strict=True)]
    lists = [s.grads for s in slots]

    assert _C.swap_gradients(slots, -1, 1, CPU) is True  # activate(1)
    for p, s, g, home in zip(params, slots, grads, primary, strict=True):
        assert s.home_grad is home and p.grad is g[1] and s.grads == g
    produced = [_rand(*p.shape, seed=50 + k) for k, p in enumerate(params)]  # replica 1's backward
    for p, g in zip(params, produced, strict=True):
        p.grad = g

    assert _C.swap_gradients(slots, 1, 2, CPU) is True  # hand_over(2)
    for p, s, g, new, home in zip(params, slots, grads, produced, primary, strict=True):
        assert s.grads[1] is new and s.grads[0] is g[0] and s.home_grad is home
        assert p.grad is g[2]  # (None for the second tensor)
    assert params[1].grad is None
    params[0].grad = last = _rand(2, 3, seed=77)

    assert _C.swap_gradients(slots, 2, -1, CPU) is True  # deactivate()
    for p, s, home in zip(params, slots, primary, strict=True):
        assert p.grad is home and s.home_grad is None
    assert slots[0].grads[2] is last and slots[1].grads[2] is None
    assert [s.grads for s in slots] == lists and all(
        s.grads is lst for s, lst in zip(slots, lists, strict=True)
    )


def test_swap_gradients_load_minus_one_with_no_home_gradient_leaves_none():
    p = nn.Parameter(_rand(4, seed=1))
    p.grad = g = _rand(4, seed=2)
    s = _slot(p, [None, None])
    assert _C.swap_gradients([s], 0, -1, CPU) is True
    assert p.grad is None and s.grads[0] is g and s.home_grad is None


def _bad_swap_case(case: str) -> tuple[torch.Tensor, ReplicaSlot, int, int, torch.device]:
    """One tensor and its slot that needs the Python path for swap (save, load) on `device`."""
    p: torch.Tensor = nn.Parameter(_rand(2, 3, seed=5))
    grads: list[Any] = [_rand(2, 3, seed=6), _rand(2, 3, seed=7)]
    save, load, device, is_param, home = 0, 1, CPU, True, None
    if case == "buffer":
        is_param = False
    elif case == "tensor_subclass":
        p = torch.Tensor._make_subclass(_Sub, _rand(2, 3, seed=5), True)
    elif case == "parameter_subclass":
        p = _TaggedParameter(_rand(2, 3, seed=5))
    elif case == "parameter_on_meta":
        p, grads = nn.Parameter(torch.empty(2, 3, dtype=F64, device="meta")), [None, None]
    elif case == "call_device_meta":
        device = torch.device("meta")
    elif case == "incoming_dtype":
        grads[1] = grads[1].float()
    elif case == "incoming_shape":
        grads[1] = _rand(3, 2, seed=7)
    elif case == "incoming_sparse":
        grads[1] = grads[1].to_sparse()
    elif case == "incoming_subclass":
        grads[1] = grads[1].as_subclass(_Sub)
    elif case == "home_grad_dtype":
        save, load, home = 1, -1, _rand(2, 3, seed=8).float()
    elif case == "index_past_the_replicas":
        save, load = 0, 2
    elif case == "grads_not_a_list":
        grads = tuple(grads)  # type: ignore[assignment]
    else:
        raise AssertionError(case)
    p.grad = _rand(2, 3, seed=9) if p.device.type == "cpu" else None
    s = _slot(p, list(grads), home, is_param)
    if case == "grads_not_a_list":
        s.grads = grads
    return p, s, save, load, device


BAD_SWAPS = [
    "buffer",
    "tensor_subclass",
    "parameter_subclass",
    "parameter_on_meta",
    "call_device_meta",
    "incoming_dtype",
    "incoming_shape",
    "incoming_sparse",
    "incoming_subclass",
    "home_grad_dtype",
    "index_past_the_replicas",
    "grads_not_a_list",
]


@pytest.mark.parametrize("case", BAD_SWAPS)
def test_swap_gradients_answers_false_and_changes_nothing_for_any_unusual_slot(case):
    """The unusual slot comes after two ordinary ones, so a swap that wrote as it went would show."""
    tensor, bad, save, load, device = _bad_swap_case(case)  # (tensor: alive, as the slot holds it weakly)
    good_params = [nn.Parameter(_rand(3, seed=k)) for k in range(2)]
    good = []
    for k, p in enumerate(good_params):
        p.grad = _rand(3, seed=20 + k)
        good.append(_slot(p, [_rand(3, seed=30 + k), _rand(3, seed=40 + k)], home=_rand(3, seed=60 + k)))
    slots = [*good, bad]
    before = _snapshot(slots)
    assert _C.swap_gradients(slots, save, load, device) is False
    _assert_unchanged(before, slots)
    assert bad.ref() is tensor
    if case not in ("call_device_meta", "index_past_the_replicas"):  # control: the ordinary slots alone swap
        assert _C.swap_gradients(good, save, load, device) is True
        assert good_params[0].grad is before[0][2 + load if load >= 0 else 4]


def test_swap_gradients_skips_slots_whose_tensor_died():
    p = nn.Parameter(_rand(3, seed=1))
    dead = nn.Parameter(_rand(5, seed=2))
    gone = _slot(dead, [None, None])
    del dead
    gc.collect()
    assert gone.ref() is None
    junk = [_rand(1, seed=3).float(), _rand(7, seed=4).to_sparse()]  # would be refused for a live tensor
    gone.grads, gone.home_grad = junk, junk[0]
    p.grad = mine = _rand(3, seed=5)
    live = _slot(p, [_rand(3, seed=6), _rand(3, seed=7)])
    incoming = live.grads[1]
    before = _snapshot([gone])
    assert _C.swap_gradients([gone, live, gone], 0, 1, CPU) is True
    _assert_unchanged(before, [gone])
    assert live.grads[0] is mine and p.grad is incoming


# -- _C.clear_gradients ------------------------------------------------------------------------------
def _groups_with_grads() -> tuple[list[dict], list[torch.Tensor]]:
    params = [nn.Parameter(_rand(2, seed=k)) for k in range(3)] + [_rand(2, seed=9).requires_grad_()]
    for k, p in enumerate(params[:3]):
        p.grad = _rand(2, seed=10 + k)  # the last one has no gradient
    return [{"params": params[:2], "lr": 0.1}, {"params": params[2:], "momentum": 0.0}], params


def test_clear_gradients_clears_every_gradient_of_every_group():
    groups, params = _groups_with_grads()
    assert _C.clear_gradients(groups) is True
    assert all(p.grad is None for p in params)
    assert _C.clear_gradients([]) is True


@pytest.mark.parametrize(
    "case", ["tensor_subclass", "parameter_subclass", "group_not_a_dict", "no_params", "params_not_a_list"]
)
def test_clear_gradients_answers_false_and_clears_nothing_for_an_unusual_group(case):
    groups, params = _groups_with_grads()
    last: dict[str, Any] = {"params": []}
    if case in ("tensor_subclass", "parameter_subclass"):
        odd = (
            torch.Tensor._make_subclass(_Sub, _rand(2, seed=8), True)
            if case == "tensor_subclass"
            else _TaggedParameter(_rand(2, seed=8))
        )
        odd.grad = _rand(2, seed=18)
        params.append(odd)
        last["params"].append(odd)
    elif case == "group_not_a_dict":
        last = type("GroupDict", (dict,), {})(params=[])
    elif case == "no_params":
        last = {"lr": 0.1}
    else:
        last["params"] = tuple(params[:1])
    groups.append(last)
    before = [p.grad for p in params]
    assert _C.clear_gradients(groups) is False
    assert all(p.grad is g for p, g in zip(params, before, strict=True))
    assert sum(g is not None for g in before) >= 3


# -- _C.sum_replica_gradients ------------------------------------------------------------------------
def _spread(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of mixed magnitudes (so that the order of the additions shows in the low bits)."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 5, shape, generator=g, dtype=F64)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)


def _summable(
    shape: tuple[int, ...], n: int, seed: int, dtype: torch.dtype
) -> tuple[nn.Parameter, ReplicaSlot]:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = torch.full(shape, 123.0, dtype=dtype)  # the stale primary gradient the sum replaces
    return p, _slot(p, [_spread(*shape, seed=seed + k, dtype=dtype) for k in range(n)])


def _check_summed(
    p: torch.Tensor,
    slot: ReplicaSlot,
    grads: list[torch.Tensor],
    copies: list[torch.Tensor],
    grads_list: list,
) -> None:
    """``p``'s replicas' gradients ``grads`` (``copies``: their values before the sum) were summed."""
    want = copies[0] + copies[1]
    for c in copies[2:]:
        want = want + c  # torch's ((g0 + g1) + g2) ...
    assert slot.grads is grads_list and slot.grads[1:] == [None] * (len(grads) - 1)
    total = slot.grads[0]
    assert p.grad is total and total.dtype == p.dtype and total.shape == p.shape
    assert torch.equal(total, want)
    # replicas 1.. keep their gradients' values; replica 0's gradient is either kept or is the total itself
    assert total is grads[0] or torch.equal(grads[0], copies[0])
    for g, c in zip(grads[1:], copies[1:], strict=True):
        assert torch.equal(g, c)
        assert total.numel() == 0 or g.data_ptr() != total.data_ptr()


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sum_replica_gradients_is_bit_for_bit_torchs_sum_in_replica_order(dtype, n):
    entries = [_summable(shape, n, 10 * k, dtype) for k, shape in enumerate([(7, 5), (5,), (0, 3), (64, 33)])]
    params = [nn.Parameter(torch.zeros(1)), *(p for p, _ in entries)]  # (an unplanned parameter first)
    plan = [(k + 1, s, CPU) for k, (_, s) in enumerate(entries)]
    grads = [list(s.grads) for _, s in entries]
    copies = [[g.clone() for g in gs] for gs in grads]
    lists = [s.grads for _, s in entries]
    if n == 3:  # the order matters for these values: only ((g0 + g1) + g2) matches everywhere
        g0, g1, g2 = grads[3]
        assert not torch.equal((g0 + g1) + g2, g0 + (g1 + g2))
        assert not torch.equal((g0 + g1) + g2, (g0 + g2) + g1)
    assert _C.sum_replica_gradients(params, plan) == []
    for (p, s), gs, cs, lst in zip(entries, grads, copies, lists, strict=True):
        _check_summed(p, s, gs, cs, lst)
    assert params[0].grad is None


@pytest.mark.parametrize("layout", ["one_tensor", "two_tensors"])
def test_sum_replica_gradients_of_large_tensors_releases_the_gil_and_sums_every_chunk(layout):
    """> 256K elements in all: the sums run without the GIL, in 32K-element chunks."""
    shapes = [(300_001,)] if layout == "one_tensor" else [(150_007,), (389, 401)]
    entries = [_summable(shape, 3, 100 * k, torch.float32) for k, shape in enumerate(shapes)]
    params = [p for p, _ in entries]
    grads = [list(s.grads) for _, s in entries]
    copies = [[g.clone() for g in gs] for gs in grads]
    lists = [s.grads for _, s in entries]
    assert _C.sum_replica_gradients(params, [(k, s, CPU) for k, (_, s) in enumerate(entries)]) == []
    for (p, s), gs, cs, lst in zip(entries, grads, copies, lists, strict=True):
        _check_summed(p, s, gs, cs, lst)


def _left_case(case: str) -> tuple[nn.Parameter, ReplicaSlot]:
    """A parameter whose replicas' gradients the C sum leaves to the Python path."""
    if case in ("float16", "bfloat16"):
        dtype = getattr(torch, case)
        p = nn.Parameter(torch.zeros(4, 3, dtype=dtype))
        return p, _slot(p, [_rand(4, 3, seed=k, dtype=dtype) for k in range(3)])
    if case == "parameter_on_meta":
        p = nn.Parameter(torch.empty(4, 3, dtype=F64, device="meta"))
        return p, _slot(p, [torch.empty(4, 3, dtype=F64, device="meta") for _ in range(3)])
    p = nn.Parameter(_rand(4, 3, seed=1))
    grads: list[Any] = [_rand(4, 3, seed=k) for k in range(3)]
    if case == "non_contiguous":
        grads[1] = _rand(3, 4, seed=7).t()
        assert grads[1].shape == p.shape and not grads[1].is_contiguous()
    elif case == "requires_grad":  # what backward(create_graph=True) leaves in .grad
        (grads[2],) = torch.autograd.grad(p.pow(3).sum(), p, create_graph=True)
        assert grads[2].requires_grad
    elif case == "none_on_one_replica":
        grads[1] = None
    elif case == "mixed_dtypes":
        grads[2] = grads[2].float()
    elif case == "other_shape":
        grads[0] = _rand(12, seed=3)
    elif case == "sparse":
        grads[1] = grads[1].to_sparse()
    elif case == "one_replica":
        grads = grads[:1]
    else:
        raise AssertionError(case)
    return p, _slot(p, grads)


LEFT = [
    "non_contiguous",
    "requires_grad",
    "none_on_one_replica",
    "float16",
    "bfloat16",
    "mixed_dtypes",
    "other_shape",
    "sparse",
    "one_replica",
    "parameter_on_meta",
]


@pytest.mark.parametrize("case", LEFT)
def test_sum_replica_gradients_leaves_unusual_gradients_to_python_untouched(case):
    p, s = _left_case(case)
    p.grad = keep = None if p.device.type == "meta" else torch.ones_like(p)
    (a, sa), (b, sb) = (_summable((5,), 3, seed, F64) for seed in (10, 20))
    params = [a, p, b]
    left_entry = (1, s, CPU)
    plan = [(0, sa, CPU), left_entry, (2, sb, CPU)]
    ga, gb, gs, lst = list(sa.grads), list(sb.grads), list(s.grads), s.grads
    ca, cb = [g.clone() for g in ga], [g.clone() for g in gb]
    left = _C.sum_replica_gradients(params, plan)
    assert len(left) == 1 and left[0] is left_entry  # the very entry, for the caller to sum
    assert p.grad is keep and s.grads is lst and all(x is y for x, y in zip(s.grads, gs, strict=True))
    _check_summed(a, sa, ga, ca, sa.grads)
    _check_summed(b, sb, gb, cb, sb.grads)


@pytest.mark.parametrize("stale", ["another_tensor", "dead_tensor"])
def test_sum_replica_gradients_answers_none_for_a_stale_plan_with_nothing_written(stale):
    (a, sa), (b, sb) = (_summable((5,), 2, seed, F64) for seed in (10, 20))
    if stale == "another_tensor":
        other = nn.Parameter(torch.zeros(5, dtype=F64))
        sb = _slot(other, list(sb.grads))  # the slot of a tensor that is not params[1]
    else:
        dying = nn.Parameter(torch.zeros(5, dtype=F64))
        sb = _slot(dying, list(sb.grads))
        del dying
        gc.collect()
        sb.grads = [_spread(5, seed=k, dtype=F64) for k in range(2)]
    before = _snapshot([sa, sb])
    values = [g.clone() for g in (*sa.grads, *sb.grads)]
    grad_a, grad_b = a.grad, b.grad
    assert _C.sum_replica_gradients([a, b], [(0, sa, CPU), (1, sb, CPU)]) is None
    _assert_unchanged(before, [sa, sb])
    assert all(torch.equal(g, v) for g, v in zip((*sa.grads, *sb.grads), values, strict=True))
    assert a.grad is grad_a and b.grad is grad_b


def test_sum_replica_gradients_names_a_malformed_plan():
    p, s = _summable((3,), 2, 1, F64)
    with pytest.raises(TypeError, match="plan entries must be"):
        _C.sum_replica_gradients([p], [s])
    with pytest.raises(IndexError, match="plan index 1 outside the 1 parameters"):
        _C.sum_replica_gradients([p], [(1, s, CPU)])


# -- _C.FrameCheck, directly ---------------------------------------------------------------------------
def _caller(fn: Callable[[], Any]) -> Any:
    return fn()  # (stands for _Replica.call: the frame that calls the replica function)


def _relay(fn: Callable[[], Any]) -> Any:
    return fn()  # an intermediate frame


def test_frame_check_finds_the_replica_function_of_a_function_or_a_bound_method():
    asked: list[tuple[str, bool]] = []

    def passes(code: Any, lasti: int, drops: bool) -> bool:
        asked.append((code.co_name, drops))
        return True

    check = _C.FrameCheck(_caller.__code__, passes, 12)

    def function() -> bool:
        return check(function, sys._getframe(0))

    class Holder:
        def method(self) -> bool:
            return check(self.method, sys._getframe(0))

    assert _caller(function) is True
    assert asked == [("function", True)]  # the replica function's frame, asked with drops=True
    assert _caller(Holder().method) is True  # a bound method: its function's code
    assert _caller(lambda: _relay(function)) is False  # function's caller is not the caller code: no
    n = check.cached
    assert _caller(function) is True and check.cached == n  # answered from the cache
    assert check(functools.partial(function), sys._getframe(0)) is False  # no code of its own
    assert check(function, "not a frame") is False
    with pytest.raises(TypeError, match="caller_code must be a code object"):
        _C.FrameCheck(_caller, passes, 12)


def test_frame_check_walks_at_most_max_depth_frames_each_of_which_must_pass_the_value_through():
    verdicts: dict[str, bool] = {}

    def passes(code: Any, lasti: int, drops: bool) -> bool:
        return verdicts.get(code.co_name, True)

    checks = [_C.FrameCheck(_caller.__code__, passes, depth) for depth in (1, 2)]

    def probe() -> list[bool]:
        frame = sys._getframe(1)  # _relay's: then fn's, then _caller's
        return [c(fn, frame) for c in checks]

    def fn() -> list[bool]:
        return _relay(probe)

    assert _caller(fn) == [False, True]  # fn's frame is the second one: one frame is too few
    verdicts["_relay"] = False  # an intermediate frame that does not return the value as it is
    checks = [_C.FrameCheck(_caller.__code__, passes, 2)]  # (a fresh cache)
    assert _caller(fn) == [False]


@pytest.mark.parametrize(
    ("local", "want"),
    [
        ("computed", True),
        ("computed_view", False),
        ("leaf_tensor", False),
        ("parameter", False),
        ("subclass", False),
        ("missing", False),
        ("int", False),
    ],
)
def test_frame_check_accepts_a_named_local_only_when_it_is_a_computed_tensor(local, want):
    """``return <local>.detach()`` and the like end the replica function only when the local is exactly a
    Tensor that autograd computed (a grad_fn) with memory of its own: a leaf (a parameter, a gradient, an
    optimizer state) or a view may be written in place by the merge."""
    check = _C.FrameCheck(_caller.__code__, lambda code, lasti, drops: "loss" if drops else True, 12)
    w = nn.Parameter(torch.ones(2))

    def fn() -> bool:
        if local == "computed":
            loss: Any = w * 2
        elif local == "computed_view":
            loss = w[0]
        elif local == "leaf_tensor":
            loss = torch.ones(1)
        elif local == "parameter":
            loss = w
        elif local == "subclass":
            loss = (w * 2).as_subclass(_Sub)
        elif local == "int":
            loss = 1  # noqa: F841  (read by the frame check, through the frame's locals)
        return check(fn, sys._getframe(0))  # (for "missing", ``loss`` is never bound)

    assert _caller(fn) is want


# -- through MirroredStrategy ------------------------------------------------------------------------
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
        if self.strategy is None:
            loss = per_example.sum() / B
        else:
            loss = ts.compute_average_loss(per_example, global_batch_size=B)
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
# Nothing of the replica runs after the step: every replica in the calling thread (docs/strategies.md).
CALLING_THREAD = {"step_last", "return_loss", "return_loss_detach", "bound_method"}
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
def test_every_shape_of_replica_function_trains_like_one_device_on_its_schedule(variant, n):
    ref_params, ref_grads, ref_final, ref_losses = _one_device()
    t, results = _train(n, variant)
    for got, want in zip(t.params(), ref_final, strict=True):
        _close(got, want)
    me = threading.current_thread()
    assert [r for r, _ in t.threads] == list(range(n)) * STEPS
    on_workers = [th is not me for r, th in t.threads if r > 0]
    assert all(th is me for r, th in t.threads if r == 0)
    assert on_workers == [variant not in CALLING_THREAD] * ((n - 1) * STEPS), variant
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
        elif variant == "read_grads_after":  # replica 0 starts from the sum, the others from None
            for g, w in zip(per_replica[0], ref_grads[k], strict=True):
                _close(g, w)
            assert all(g is None for got in per_replica[1:] for g in got)
        else:
            raise AssertionError(per_replica)
    assert t.finally_ran == (n * STEPS if variant == "try_finally" else 0)


class _Counting:
    """``_C`` with the four functions counted (their "mine" answers), everything else passed through."""

    def __init__(self, python: bool):
        self.python = python  # True: every function answers "not mine" (the Python paths run)
        self.mine = {"swap_gradients": 0, "clear_gradients": 0, "sum_replica_gradients": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(_C, name)

    def swap_gradients(self, *args: Any) -> bool:
        done = not self.python and _C.swap_gradients(*args)
        self.mine["swap_gradients"] += done
        return done

    def clear_gradients(self, groups: Any) -> bool:
        done = not self.python and _C.clear_gradients(groups)
        self.mine["clear_gradients"] += done
        return done

    def sum_replica_gradients(self, params: Any, plan: Any) -> Any:
        if self.python:
            return list(plan)
        left = _C.sum_replica_gradients(params, plan)
        self.mine["sum_replica_gradients"] += left is not None and len(left) < len(plan)
        return left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["step_last", "read_grads_after", "partial"])
def test_c_paths_equal_their_python_fallbacks_bit_for_bit(monkeypatch, variant):
    """The same training (3 replicas) with the C functions, then with each answering "not mine" and the
    frame check answering False (every replica on a worker): the same parameters and results exactly."""
    outcomes = []
    for python in (False, True):
        fake = _Counting(python)
        monkeypatch.setattr(replicated, "_C", fake)
        monkeypatch.setattr(mirrored, "_C", fake)
        if python:
            monkeypatch.setattr(mirrored_run, "_ends_replica_fn", lambda fn, frame: False)
        t, results = _train(3, variant)
        if python:
            assert all(th is not threading.current_thread() for r, th in t.threads if r > 0)
        else:
            assert all(fake.mine.values()), fake.mine  # the training really went through the C paths
        outcomes.append((t.params(), results))
    (params, results), (ref_params, ref_results) = outcomes
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    for got, want in zip(results, ref_results, strict=True):
        flat_got = [g for r in got or [] for g in r]
        flat_want = [g for r in want or [] for g in r]
        assert len(flat_got) == len(flat_want)
        assert all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(flat_got, flat_want, strict=True)
        )


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["tensor_subclass", "parameter_subclass", "transposed", "create_graph"])
def test_parameters_and_gradients_the_c_paths_leave_to_python_train_like_one_device(kind, n):
    """A tensor subclass and a Parameter subclass (zero_grad and the swap in Python), a non-contiguous
    parameter (so are its gradients: the sum in Python) and create_graph gradients (requiring grad: the sum
    in Python)."""
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
            assert _C.clear_gradients(t.opt.param_groups) is False
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
    step updates (or a view of one): as written, every replica reads the updated value (what the worker
    schedule returns). (The calling-thread shortcut once took these as pure reads of a finished value.)"""
    out = []
    for timeout in (None, 30.0):  # 30.0: every replica on a worker (the reference schedule)
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
