"""The in-process replica engine (MirroredStrategy, CentralStorageStrategy): every replica owns its
component of every replicated tensor, so what a replica writes lands once, in its own copy; a parameter no
replica gave a gradient keeps ``.grad is None``; objects made outside the scope are refused where they
would step once per replica; a cross-replica write reaches every replica, whatever wrote it.

The conformance matrix (tests/test_conformance.py) holds the training rows; these are the smaller cases.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchstrategies as ts

STRATEGIES = {
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
}
B = 12


def _split(s, t):
    n = s.num_replicas_in_sync
    return s.experimental_distribute_values_from_function(lambda c: t.chunk(n)[c.replica_id_in_sync_group])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_model_and_optimizer_made_outside_the_scope_and_stepped_in_run_are_refused(name):
    s = STRATEGIES[name]()
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def step(x):
        opt.zero_grad()
        ts.compute_average_loss(model(x).sum(1), global_batch_size=B).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"created outside `with strategy.scope\(\):`.*once per replica"):
        s.run(step, args=(_split(s, torch.ones(B, 3)),))
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_model_made_outside_the_scope_trains_like_one_device_with_the_step_outside_run():
    """Backward inside run and the step outside it: every replica accumulates into the one .grad."""
    x = torch.randn(B, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = []
    for s in (None, ts.MirroredStrategy(num_replicas=3)):
        torch.manual_seed(0)
        model = nn.Linear(3, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            if s is None:
                (model(x).pow(2).sum() / B).backward()
            else:
                s.run(lambda xb: ts.compute_average_loss(model(xb).pow(2).sum(1), global_batch_size=B).backward(),
                      args=(_split(s, x),))
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_write_inside_run_lands_once_in_each_replicas_own_component(name):
    s = STRATEGIES[name]()
    with s.scope():
        counter = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        counter.weight.fill_(1.0)

    def bump():
        with torch.no_grad():
            counter.weight.mul_(2.0)
        return counter.weight.detach().clone()

    seen = s.experimental_local_results(s.run(bump))
    assert [float(v) for v in seen] == [2.0] * s.num_replicas_in_sync  # not 2, 4, 8
    assert float(counter.weight.detach()) == 2.0  # cross-replica: replica 0's component (TF's primary)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize(
    "write",
    ["copy_", "data_mul_", "load_state_dict", "fused_adam_step", "assign_data"],
)
def test_a_cross_replica_write_between_runs_reaches_every_replica(name, write):
    """Whatever wrote the parameter outside run (in place, through .data, which moves no version counter,
    a fused optimizer, which does not either, or a new .data), every replica computes with the new value."""
    s = STRATEGIES[name]()
    with s.scope():
        lin = nn.Linear(2, 1, bias=False)
        opt = torch.optim.Adam(lin.parameters(), lr=0.5, fused=True)
    s.run(lambda: lin.weight.sum())  # every replica has seeded its component
    with torch.no_grad():
        if write == "copy_":
            lin.weight.copy_(torch.tensor([[3.0, 4.0]]))
        elif write == "data_mul_":
            lin.weight.data.mul_(0.0)
        elif write == "load_state_dict":
            lin.load_state_dict({"weight": torch.tensor([[5.0, 6.0]])})
        elif write == "assign_data":
            lin.weight.data = torch.tensor([[7.0, 8.0]])
    if write == "fused_adam_step":
        lin.weight.grad = torch.ones(1, 2)
        opt.step()
    want = lin.weight.detach().clone()
    seen = s.experimental_local_results(s.run(lambda: lin.weight.detach().clone()))
    for v in seen:
        torch.testing.assert_close(v, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_fused_optimizer_step_inside_run_reaches_every_replica_before_it_resumes(name):
    s = STRATEGIES[name]()
    with s.scope():
        lin = nn.Linear(2, 1, bias=False)
        opt = torch.optim.AdamW(lin.parameters(), lr=0.5, fused=True)

    def step():
        opt.zero_grad()
        lin(torch.ones(1, 2)).sum().backward()
        opt.step()  # fused: the update moves no version counter
        return lin.weight.detach().clone()

    seen = s.experimental_local_results(s.run(step))
    for v in seen:
        torch.testing.assert_close(v, lin.weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_parameter_only_some_replicas_gave_a_gradient_sums_those_and_one_no_replica_used_keeps_none(name):
    s = STRATEGIES[name]()
    with s.scope():
        a, b, c = (nn.Linear(1, 1, bias=False).double() for _ in range(3))
    for m, w in ((a, 1.0), (b, 1.0), (c, 1.0)):
        with torch.no_grad():
            m.weight.fill_(w)
    x = torch.ones(1, 1, dtype=torch.float64)

    def fn():
        rid = ts.get_replica_context().replica_id_in_sync_group
        out = a(x) * (rid + 1)
        if rid == 0:
            out = out + b(x) * 10.0  # only replica 0 uses b; nobody uses c
        out.sum().backward()

    s.run(fn)
    n = s.num_replicas_in_sync
    assert float(a.weight.grad) == sum(range(1, n + 1))
    assert float(b.weight.grad) == 10.0
    assert c.weight.grad is None


def test_reduce_along_an_axis_the_value_lacks_is_a_value_error_naming_the_axis_and_the_rank():
    s = ts.MirroredStrategy(num_replicas=2)
    scalar = s.experimental_distribute_values_from_function(lambda c: torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"reduce\(axis=1\).*rank 0"):
        s.reduce("mean", scalar, axis=1)
    matrix = s.experimental_distribute_values_from_function(lambda c: torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"reduce\(axis=2\).*rank 2 \(shape \(2, 3\)\)"):
        s.reduce("sum", matrix, axis=2)
    assert torch.equal(s.reduce("sum", matrix, axis=-1), torch.tensor([6.0, 6.0]))


def test_a_lazy_module_must_take_its_shapes_before_run_and_then_trains_like_one_device():
    x = torch.randn(B, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for s in (None, ts.MirroredStrategy(num_replicas=2)):
        torch.manual_seed(0)
        with s.scope() if s is not None else torch.no_grad():
            model = nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1)).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xb):
            opt.zero_grad()
            ts.compute_average_loss(model(xb).pow(2).sum(1), global_batch_size=B).backward()
            opt.step()

        if s is not None:
            with pytest.raises(RuntimeError, match="not initialized yet.*call the model once on a batch"):
                s.run(step, args=(_split(s, x),))
        with torch.no_grad():
            model(x[:1])  # takes its shapes (initialized from the same seed in both)
        for _ in range(3):
            step(x) if s is None else s.run(step, args=(_split(s, x),))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("method", ["EXPERIMENTAL_ACCUMULATE_N", "EXPERIMENTAL_TREE", "ADD_N", "callable"])
def test_the_fold_sums_into_replica_0s_own_gradient_with_every_aggregation_method(name, method):
    """After backward() in run, replica 0's .grad is the very tensor autograd gave it, now holding the sum
    (no new tensor per step, as DDP reduces into .grad), and the sum equals one device's gradient, whatever
    kernel sums it; the other replicas hold a copy of their own."""
    fn = (lambda ts_: torch.stack(ts_).sum(0)) if method == "callable" else getattr(ts.AggregationMethod, method)
    ops = ts.ReductionToOneDevice(accumulation_fn=fn)
    if name == "central_storage":
        s = ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu", cross_device_ops=ops)
    else:
        s = ts.MirroredStrategy([f"cpu:{i}" for i in range(int(name[-1]))], cross_device_ops=ops)
    torch.manual_seed(0)
    with s.scope():
        lin = nn.Linear(3, 2).double()
    ref = nn.Linear(3, 2).double()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(B, 3, dtype=torch.float64)
    made: dict[int, torch.Tensor] = {}

    def keep(p):
        if p is lin.weight:
            made[ts.get_replica_context().replica_id_in_sync_group] = p.grad

    hook = lin.weight.register_post_accumulate_grad_hook(ts.linear_gradient_hook(keep))  # (it only reads)

    def step(xb):
        ts.compute_average_loss(lin(xb).pow(2).sum(1), global_batch_size=B).backward()
        return lin.weight.grad

    grads = s.experimental_local_results(s.run(step, args=(_split(s, x),)))
    hook.remove()
    ref(x).pow(2).sum(1).div(B).sum().backward()
    for g in grads:
        torch.testing.assert_close(g, ref.weight.grad, rtol=1e-12, atol=0)
    if method != "callable":
        assert grads[0] is made[0]  # summed in place
    assert all(g is not grads[0] for g in grads[1:])


def test_a_refresh_inside_a_merge_keeps_every_replica_on_its_own_component():
    """Cross-replica code inside run may look the replicated set up again (replica_components refreshes
    it); the run goes on with every tensor it holds, and trains like one device."""
    s = ts.MirroredStrategy(num_replicas=2)
    torch.manual_seed(0)
    with s.scope():
        lin = nn.Linear(3, 1).double()
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    ref = nn.Linear(3, 1).double()
    ref.load_state_dict(lin.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(B, 3, dtype=torch.float64)

    def look(strategy):
        comps = strategy.extended.replica_components(lin.weight)
        assert len(comps) == 2 and comps[0] is lin.weight and comps[1] is not lin.weight

    def step(xb):
        opt.zero_grad()
        ts.compute_average_loss(lin(xb).sum(1), global_batch_size=B).backward()
        ts.get_replica_context().merge_call(look)
        opt.step()
        return lin.weight.detach().clone()

    for _ in range(3):
        seen = s.experimental_local_results(s.run(step, args=(_split(s, x),)))
        ref_opt.zero_grad()
        ref(x).sum(1).div(B).sum().backward()
        ref_opt.step()
        for v in seen:
            torch.testing.assert_close(v, ref.weight.detach(), rtol=1e-12, atol=0)
