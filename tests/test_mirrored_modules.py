"""What scope() does to modules and optimizers under MirroredStrategy: per-replica copies, one update,
ON_READ/MEAN buffers, state_dict, optimizer state kept once."""

from __future__ import annotations

import copy

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import replica_id as _rid


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One training step with the sum of ``model(x)`` as the loss."""
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def _scalar_model_at_zero() -> tuple[ts.MirroredStrategy, torch.nn.Linear, torch.optim.Optimizer]:
    """Two replicas and, made in their scope, a 1x1 linear map at weight 0 and SGD with lr 1: one step
    leaves minus the summed gradient in the weight."""
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        lin = torch.nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    with torch.no_grad():
        lin.weight.fill_(0.0)
    return s, lin, opt


def test_parameters_and_buffers_created_in_scope_are_replicated():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    outside = torch.nn.Linear(3, 4)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # plain tensors, torch-compatible
    assert all(len(s.extended.replica_components(t)) == 2 for t in [*model.parameters(), *model.buffers()])
    assert len(s.extended.replica_components(outside.weight)) == 1
    assert s.extended.variable_created_in_scope(model[0].weight)
    assert not s.extended.variable_created_in_scope(outside.weight)


def test_each_replica_computes_with_its_own_copy_and_reads_the_global_gradient_after_backward():
    s = ts.MirroredStrategy(num_replicas=3)
    with s.scope():
        lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0]]))

    def fn():
        x = torch.full((1, 2), float(_rid() + 1))
        lin(x).sum().backward()
        return lin.weight.grad.clone()

    grads = s.experimental_local_results(s.run(fn))
    for g in grads:  # after backward every replica holds the sum of 1, 2 and 3, as one device would
        torch.testing.assert_close(g, torch.full((1, 2), 6.0))
    # cross-replica context sees the sum, as one device's .grad after the three slices' backward passes
    torch.testing.assert_close(lin.weight.grad, torch.full((1, 2), 6.0))
    comps = s.extended.replica_components(lin.weight)
    assert comps[0] is lin.weight  # replica 0's component is the primary (TF's MirroredVariable)
    assert len({c.data_ptr() for c in comps}) == 3  # every other replica owns a copy, CPU replicas too
    assert all(torch.equal(c, lin.weight.detach()) for c in comps)


def test_optimizer_step_in_run_sums_gradients_updates_once_and_keeps_replicas_identical():
    s = ts.MirroredStrategy(num_replicas=3)
    with s.scope():
        lin = torch.nn.Linear(2, 1, bias=False)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    with torch.no_grad():
        lin.weight.zero_()
    step_calls = []
    opt.register_step_pre_hook(lambda *a: step_calls.append(1))

    def fn():
        _train_step(lin, opt, torch.full((1, 2), float(_rid() + 1)))
        return lin.weight.detach().clone()

    after = s.experimental_local_results(s.run(fn))
    expected = torch.full((1, 2), -0.5 * (1 + 2 + 3))
    assert len(step_calls) == 1  # one update, not one per replica
    for w in after:
        torch.testing.assert_close(w, expected)
    torch.testing.assert_close(lin.weight.detach(), expected)
    out = s.run(lambda: lin.weight.detach().clone())  # copies refreshed on the next run too
    for w in s.experimental_local_results(out):
        torch.testing.assert_close(w, expected)


def test_optimizer_state_is_kept_once_on_the_primary():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        lin = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    for _ in range(2):
        s.run(lambda: _train_step(lin, opt, torch.ones(2, 3)))
    assert len(opt.state) == 2 and set(map(id, opt.state)) == {id(lin.weight), id(lin.bias)}
    assert all(int(st["step"]) == 2 for st in opt.state.values())


def test_step_with_closure_inside_run_is_rejected():
    s, _, opt = _scalar_model_at_zero()
    with pytest.raises(ValueError, match="closure"):
        s.run(lambda: opt.step(lambda: 0.0))


def test_step_outside_run_aggregates_replica_gradients():
    s, lin, opt = _scalar_model_at_zero()
    s.run(lambda: lin(torch.full((1, 1), float(_rid() + 1))).sum().backward())
    opt.step()  # cross-replica context
    assert float(lin.weight.detach()) == -3.0


def test_batchnorm_statistics_are_on_read_mean():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        bn = torch.nn.BatchNorm1d(2, momentum=0.5)
    data = [torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[10.0, 20.0], [30.0, 40.0]])]
    v = s.experimental_distribute_values_from_function(lambda ctx: data[ctx.replica_id_in_sync_group])
    means = s.run(lambda x: (bn(x), bn.running_mean.clone())[1], args=(v,))
    local = [0.5 * d.mean(0) for d in data]
    for m, ref in zip(s.experimental_local_results(means), local, strict=False):
        torch.testing.assert_close(m, ref)  # replicas read their own statistics
    expected = (local[0] + local[1]) / 2
    torch.testing.assert_close(bn.running_mean.clone(), expected)  # cross-replica read: the MEAN
    sd = bn.state_dict()
    torch.testing.assert_close(sd["running_mean"], expected)
    assert type(sd["running_mean"]) is torch.Tensor
    assert int(sd["num_batches_tracked"]) == 1  # integer buffer: ONLY_FIRST_REPLICA
    bn.reset_running_stats()  # a cross-replica write reaches every replica
    out = s.run(lambda: bn.running_mean.clone())
    for m in s.experimental_local_results(out):
        torch.testing.assert_close(m, torch.zeros(2))


def test_load_state_dict_and_module_conversion_after_scope():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ref = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.load_state_dict(ref.state_dict())
    model.double()
    out = s.run(lambda: model[0].weight.detach().clone())
    for w in s.experimental_local_results(out):
        assert w.dtype == torch.float64
        torch.testing.assert_close(w, ref[0].weight.detach().double())
    s.run(lambda: model(torch.ones(2, 2, dtype=torch.float64)))
    comps = s.extended.replica_components(model[1].running_mean)
    assert comps[0] is model[1].running_mean and comps[1].dtype == torch.float64


def test_deepcopy_gives_a_plain_module():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    clone = copy.deepcopy(model)
    assert type(clone[0].weight) is torch.nn.Parameter and type(clone[1].running_mean) is torch.Tensor
    torch.testing.assert_close(clone[0].weight, model[0].weight.detach())


def test_clip_grad_norm_inside_run_acts_on_the_global_gradient():
    s, lin, opt = _scalar_model_at_zero()

    def fn():
        opt.zero_grad()
        lin(torch.full((1, 1), 10.0 * (_rid() + 1))).sum().backward()
        torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
        opt.step()

    s.run(fn)
    assert float(lin.weight.detach()) == pytest.approx(
        -1.0, rel=1e-6
    )  # the global gradient (10 + 20) clipped to 1, as on one device


def test_optimizer_created_outside_scope_is_refused_inside_run():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        lin = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="created outside `with strategy.scope\\(\\):`"):
        s.run(lambda: _train_step(lin, opt, torch.ones(1, 1)))


def test_tied_weights_stay_one_parameter_and_lazy_modules_are_left_alone():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        emb = torch.nn.Embedding(5, 3)
        head = torch.nn.Linear(3, 5, bias=False)
        head.weight = emb.weight
        lazy = torch.nn.LazyLinear(2)
    assert head.weight is emb.weight and type(emb.weight) is torch.nn.Parameter
    assert torch.nn.parameter.is_lazy(lazy.weight)
    lazy(torch.ones(1, 4))
    assert lazy.weight.shape == (2, 4)


class _LastMean(torch.nn.Module):
    """A floating buffer written in forward: the mean of the last batch (BatchNorm with momentum 1), declared
    MEAN as BatchNorm's statistics are."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(1))
        ts.declare_buffer_aggregation(self, "running_mean", "mean")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running_mean.copy_(x.mean(0))
        return x


def test_on_read_buffer_fold_counts_replicas_that_skipped_the_buffer_at_their_seeded_value():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        bn = _LastMean()
    x = s.experimental_distribute_values_from_function(
        lambda c: torch.full((2, 1), 4.0 * (c.replica_id_in_sync_group + 1))
    )
    s.run(bn, args=(x,))
    assert float(bn.running_mean) == 6.0  # mean of 4 and 8; the copies are re-seeded with 6

    def only_replica_0(v):
        if ts.get_replica_context().replica_id_in_sync_group == 0:
            bn(v)

    s.run(only_replica_0, args=(x,))  # replica 0 now holds 4; replica 1 never touched it: still 6
    assert float(bn.running_mean) == 5.0
