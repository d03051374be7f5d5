"""ts.nn.SyncBatchNorm in the in-process strategies: N replicas on a global batch B train exactly like one
device on B (weights and running statistics), uneven and empty replica batches, gradcheck of the backward,
torch.nn.SyncBatchNorm's state_dict keys, convert_sync_batchnorm, plain BatchNorm outside a strategy, and
errors (issue 12, item 5)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstrategies as ts
from tests._sync_bn_common import (
    assert_state_close,
    batches,
    conv_net,
    make_distributed,
    train_distributed,
    train_one_device,
    train_step,
)
from torchstrategies.nn._sync_bn_function import sync_batch_norm

STRATEGIES = {
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage2": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


@pytest.mark.parametrize("zero_first", [True, False], ids=["zero_grad_first", "zero_grad_after_step"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_replicas_on_a_global_batch_train_like_one_device(name, zero_first):
    data = batches([12, 12, 12])
    want = train_one_device(data, zero_first)
    got = train_distributed(STRATEGIES[name](), data, zero_first)
    assert_state_close(got, want)
    assert int(got["1.num_batches_tracked"]) == 3


def test_uneven_and_empty_replica_batches_train_like_one_device():
    # 7 rows on 3 replicas: [3, 2, 2]; 5 rows: [2, 2, 1]; 2 rows: [1, 1, 0] (one replica empty)
    data = batches([7, 5, 2], torch.float64)
    want = train_one_device(data, zero_first=True, dtype=torch.float64)
    got = train_distributed(ts.MirroredStrategy(num_replicas=3), data, True, torch.float64)
    assert_state_close(got, want, rtol=1e-9, atol=1e-12)


def test_plain_batchnorm_without_sync_differs_so_the_parity_test_can_fail():
    data = batches([12, 12])
    want = train_one_device(data, zero_first=True)
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        model = conv_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for (x, _), b in zip(data, s.experimental_distribute_dataset(data), strict=True):
        s.run(train_step(model, opt, True, x.shape[0]), args=b)
    got = model.state_dict()
    assert not torch.allclose(torch.as_tensor(got["1.running_var"]), want["1.running_var"], rtol=1e-4)


class _FakeReplicas:
    """Replica 0 of ``n`` in one thread: the other replicas' batches are fixed data, and they send zero
    gradient sums (their outputs are not part of the function being checked)."""

    def __init__(self, others: list[torch.Tensor]):
        self.others = others
        self.num_replicas = len(others) + 1
        self.replica_id = 0
        self.calls: list[int] = []

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(t.numel())
        if t.dim() == 2:  # forward: one row of (mean, var, count) per replica
            out = t.clone()
            for i, x in enumerate(self.others, start=1):
                c = x.shape[1]
                if x.numel():
                    var, mean = torch.var_mean(x, dim=[0] + list(range(2, x.dim())), correction=0)
                    out[i, :c], out[i, c:2 * c] = mean, var
                out[i, 2 * c] = x.numel() // c
            return out
        return t.clone()


@pytest.mark.parametrize("shape", [(3, 2, 4), (2, 3), (2, 2, 2, 3)])
def test_backward_passes_gradcheck_in_float64(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    c = shape[1]
    w = torch.randn(c, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(c, dtype=torch.float64, generator=g, requires_grad=True)
    others = [torch.randn(4, *shape[1:], dtype=torch.float64, generator=g) + 3, torch.zeros(0, *shape[1:])]
    comm = _FakeReplicas(others)
    assert torch.autograd.gradcheck(lambda x, w, b: sync_batch_norm(x, w, b, 1e-5, comm)[0], (x, w, b))
    assert 2 * c in comm.calls  # the backward all-reduced the two gradient sums


def test_input_gradients_across_replicas_equal_plain_batchnorm_on_the_global_batch():
    """The cross-replica terms of the backward (replica j's output depends on replica i's input)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 3, 5, dtype=torch.float64, generator=g) * 3 + 1
    dy = torch.randn(9, 3, 5, dtype=torch.float64, generator=g)
    w = torch.randn(3, dtype=torch.float64, generator=g)
    xr = x.clone().requires_grad_(True)
    ref = nn.BatchNorm1d(3).double()
    with torch.no_grad():
        ref.weight.copy_(w)
    (ref(xr) * dy).sum().backward()

    s = ts.MirroredStrategy(num_replicas=3)
    with s.scope():
        bn = nn.BatchNorm1d(3).double()
    bn = ts.nn.SyncBatchNorm.convert_sync_batchnorm(bn)
    with torch.no_grad():
        bn.weight.copy_(w)
    xs = s.experimental_distribute_values_from_function(
        lambda c: x[3 * c.replica_id_in_sync_group:][:3].clone().requires_grad_(True))
    dys = s.experimental_distribute_values_from_function(lambda c: dy[3 * c.replica_id_in_sync_group:][:3])

    def step(xi, dyi):
        (bn(xi) * dyi).sum().backward()
        return xi.grad

    gx = s.run(step, args=(xs, dys))
    torch.testing.assert_close(torch.cat(s.experimental_local_results(gx)), xr.grad, rtol=1e-10, atol=1e-12)
    # cross-replica context after run: each parameter's gradient is the sum of the replicas'
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bn.bias.grad, ref.bias.grad, rtol=1e-10, atol=1e-12)


def test_backward_run_on_another_thread_still_synchronizes():
    """Autograd runs a CUDA backward on its device thread; a user thread running backward is the CPU
    stand-in: the replica's all-reduce is made on behalf of the (blocked) replica thread."""
    data = batches([8, 8])
    want = train_one_device(data, zero_first=True)
    s = ts.MirroredStrategy(num_replicas=2)
    model, opt = make_distributed(s)

    def step(x, y):
        opt.zero_grad()
        loss = ts.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=8)
        errors = []

        def backward():
            try:
                loss.backward()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)

        t = threading.Thread(target=backward)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive() and not errors, errors
        opt.step()

    for b in s.experimental_distribute_dataset(data):
        s.run(step, args=b)
    assert_state_close({k: torch.as_tensor(v) for k, v in model.state_dict().items()}, want)


def test_backward_outside_run_under_mirrored_raises_instead_of_hanging():
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        bn = ts.nn.SyncBatchNorm(2)
    x = s.experimental_distribute_values_from_function(lambda c: torch.randn(3, 2, requires_grad=True))
    out = s.run(bn, args=(x,))
    with pytest.raises(RuntimeError, match="must happen inside strategy.run"):
        s.experimental_local_results(out)[0].sum().backward()


def test_eval_mode_uses_running_statistics_without_communication(monkeypatch):
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        bn = ts.nn.SyncBatchNorm(3)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))
        bn.running_var.copy_(torch.tensor([4.0, 1.0, 0.25]))
    bn.eval()

    def no_all_reduce(*a, **k):
        raise AssertionError("eval mode must not communicate")

    monkeypatch.setattr(ts.ReplicaContext, "all_reduce", no_all_reduce)
    x = torch.randn(4, 3)
    out = s.run(bn, args=(x,))
    want = (x - torch.tensor([1.0, 2.0, 3.0])) / torch.sqrt(torch.tensor([4.0, 1.0, 0.25]) + 1e-5)
    for o in s.experimental_local_results(out):
        torch.testing.assert_close(o, want)


def test_outside_a_strategy_it_is_plain_batchnorm():
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, momentum=0.3)
    sbn = ts.nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(4, momentum=0.3))
    sbn.load_state_dict(ref.state_dict())
    for _ in range(2):
        x = torch.randn(5, 4, 3, 3)
        torch.testing.assert_close(sbn(x), ref(x))
    torch.testing.assert_close(sbn.running_var, ref.running_var)
    with ts.MirroredStrategy(num_replicas=1).scope():  # one replica: also plain
        pass
    one = ts.MirroredStrategy(num_replicas=1)
    x = torch.randn(5, 4, 3, 3)
    torch.testing.assert_close(one.run(sbn, args=(x,)), ref(x))


def test_state_dict_keys_and_signature_match_torch_syncbatchnorm():
    for kw in ({}, {"affine": False}, {"track_running_stats": False}, {"bias": False}):
        ours = ts.nn.SyncBatchNorm(6, **kw).state_dict()
        theirs = torch.nn.SyncBatchNorm(6, **kw).state_dict()
        assert list(ours) == list(theirs), kw
        assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype for k in ours)
    m = ts.nn.SyncBatchNorm(3, 1e-3, 0.2, True, True, None, "cpu", torch.float64)
    assert (m.eps, m.momentum, m.weight.dtype) == (1e-3, 0.2, torch.float64)
    m.load_state_dict(torch.nn.SyncBatchNorm(3, dtype=torch.float64).state_dict())


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_training_flag():
    net = nn.Sequential(nn.Conv1d(2, 3, 1), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm3d(2, affine=False)))
    net[1].running_mean.fill_(0.5)
    net[1].num_batches_tracked.fill_(7)
    net[2][0].eval()
    w = net[1].weight
    conv = ts.nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert conv is net and isinstance(net[0], nn.Conv1d)
    assert isinstance(net[1], ts.nn.SyncBatchNorm) and isinstance(net[2][0], ts.nn.SyncBatchNorm)
    assert net[1].weight is w and float(net[1].running_mean[0]) == 0.5
    assert int(net[1].num_batches_tracked) == 7
    assert net[2][0].weight is None and not net[2][0].training and net[1].training
    single = ts.nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(5, eps=1e-3, momentum=None))
    assert isinstance(single, ts.nn.SyncBatchNorm) and single.eps == 1e-3 and single.momentum is None


def test_bad_input_and_arguments_raise_clear_errors():
    bn = ts.nn.SyncBatchNorm(4)
    wrong = r"num_features=4\) expected 4 channels.*got 3 \(input shape \(2, 3, 5\)\)"
    with pytest.raises(ValueError, match=wrong):
        bn(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match=r"at least 2 dimensions.*got 1D"):
        bn(torch.randn(4))
    with pytest.raises(ValueError, match="process_group must be None"):
        ts.nn.SyncBatchNorm(4, process_group=object())
    with pytest.raises(ValueError, match="num_features must be a positive integer, got 0"):
        ts.nn.SyncBatchNorm(0)
    s = ts.MirroredStrategy(num_replicas=2)
    with s.scope():
        sbn = ts.nn.SyncBatchNorm(2)
    one_row = s.experimental_distribute_values_from_function(
        lambda c: torch.randn(1 - c.replica_id_in_sync_group, 2))
    with pytest.raises(ValueError, match="more than 1 value per channel.*got 1 over all 2 replicas"):
        s.run(sbn, args=(one_row,))
