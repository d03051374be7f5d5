"""MirroredStrategy on CPU replicas: run, merge_call, reduce/gather, contexts (ported from TF's
strategy_common_test, distribute_lib_test and mirrored_strategy_test)."""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import all_but_one_merge
from tests._mirrored_common import replica_id as _rid
from torchstrategies.distribute.values import Mirrored, PerReplica


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}rep")
def strategy(request):
    return ts.MirroredStrategy(num_replicas=request.param)


def test_num_replicas_and_devices():
    s = ts.MirroredStrategy(["cpu:0", "/cpu:1", "/device:CPU:2"])
    assert s.num_replicas_in_sync == 3
    assert s.extended.worker_devices == (torch.device("cpu"),) * 3


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:0"], ["cpu:1", "/device:CPU:1"], ["cuda:0", "/gpu:0"]])
def test_duplicate_devices_raise_value_error(devices):
    with pytest.raises(ValueError, match="No duplicates allowed"):
        ts.MirroredStrategy(devices)


def test_invalid_devices_and_arguments():
    with pytest.raises(ValueError, match="empty"):
        ts.MirroredStrategy([])
    with pytest.raises(ValueError, match="Invalid device 'tpu:0'"):
        ts.MirroredStrategy(["tpu:0"])
    with pytest.raises(ValueError, match="either devices or num_replicas"):
        ts.MirroredStrategy(["cpu:0"], num_replicas=2)
    with pytest.raises(ValueError, match="positive integer"):
        ts.MirroredStrategy(num_replicas=0)
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        ts.MirroredStrategy(num_replicas=2, cross_device_ops="nccl")


def test_run_gives_each_replica_its_id_and_context(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = ts.get_replica_context()
        assert ts.get_strategy() is strategy and ts.has_strategy() and not ts.in_cross_replica_context()
        assert ctx.num_replicas_in_sync == n
        return ctx.replica_id_in_sync_group

    assert strategy.experimental_local_results(strategy.run(fn)) == tuple(range(n))


def test_run_unwraps_per_replica_arguments(strategy):
    n = strategy.num_replicas_in_sync
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group * 10))
    )
    out = strategy.run(lambda x, y, k=None: x + y + k, args=(v, 1.0), kwargs={"k": v})
    assert [float(t) for t in strategy.experimental_local_results(out)] == [20.0 * i + 1 for i in range(n)]


def test_run_returns_structures_of_per_replica(strategy):
    out = strategy.run(lambda: {"a": torch.tensor(float(_rid())), "b": (torch.tensor(1.0), "const")})
    assert out["b"][1] == "const"  # the same object everywhere is returned unwrapped
    if strategy.num_replicas_in_sync > 1:
        assert isinstance(out["a"], PerReplica)
    assert float(strategy.reduce("sum", out["a"], axis=None)) == sum(range(strategy.num_replicas_in_sync))


def test_run_with_different_structures_raises():
    s = ts.MirroredStrategy(num_replicas=2)
    with pytest.raises(ValueError, match="different"):
        s.run(lambda: (1,) if _rid() == 0 else (1, 2))


def test_run_propagates_replica_exception():
    s = ts.MirroredStrategy(num_replicas=3)

    def fn():
        if _rid() == 1:
            raise KeyError("boom in replica 1")
        return ts.get_replica_context().merge_call(lambda strategy: 1)

    with pytest.raises(KeyError, match="boom in replica 1"):
        s.run(fn)
    assert s.experimental_local_results(s.run(lambda: _rid())) == (0, 1, 2)  # still usable


@pytest.mark.timeout(30)
def test_different_merge_call_counts_raise_runtime_error_not_hang():
    s = ts.MirroredStrategy(num_replicas=3)
    with pytest.raises(
        RuntimeError, match="different number of replica_context\\(\\).merge_call\\(\\) calls"
    ):
        s.run(all_but_one_merge(skipper=2))


def test_merge_call_groups_arguments_and_returns_each_replica_its_part():
    s = ts.MirroredStrategy(num_replicas=3)
    seen = {}

    def merge_fn(strategy, x, same):
        seen["cross"] = ts.in_cross_replica_context() and ts.get_replica_context() is None
        seen["x"] = strategy.experimental_local_results(x)
        seen["same"] = same
        return PerReplica(tuple(c * 2 for c in x.values))

    out = s.run(lambda: ts.get_replica_context().merge_call(merge_fn, args=(_rid() + 1, "s")))
    assert seen == {"cross": True, "x": (1, 2, 3), "same": "s"}
    assert s.experimental_local_results(out) == (2, 4, 6)


def test_reduce_inside_run_points_to_merge_call():
    s = ts.MirroredStrategy(num_replicas=2)

    def fn():
        s.reduce("sum", torch.tensor(1.0), axis=None)

    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(fn)


def test_scope_inside_run_and_mixing_strategies_raise():
    a, b = ts.MirroredStrategy(num_replicas=2), ts.MirroredStrategy(num_replicas=2)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        a.run(lambda: a.scope().__enter__())
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            b.scope().__enter__()
        with pytest.raises(RuntimeError, match="Mixing different"):
            b.run(lambda: 1)


@pytest.mark.parametrize("op", ["sum", "SUM", ts.ReduceOp.SUM, "mean", ts.ReduceOp.MEAN])
def test_reduce_basics_accepts_strings_and_enums(strategy, op):
    n = strategy.num_replicas_in_sync
    v = strategy.run(lambda: torch.tensor(float(_rid() + 1)))
    expected = sum(range(1, n + 1)) / (n if "mean" in str(op).lower() else 1)
    assert float(strategy.reduce(op, v, axis=None)) == pytest.approx(expected, rel=0, abs=0)


def test_reduce_invalid_op():
    s = ts.MirroredStrategy(num_replicas=2)
    with pytest.raises(ValueError, match="Invalid reduce op"):
        s.reduce("prod", s.run(lambda: torch.tensor(1.0)), axis=None)


def test_reduce_non_distributed_value_follows_tf():
    s = ts.MirroredStrategy(num_replicas=2)
    assert float(s.reduce("mean", torch.tensor(3.0), axis=None)) == 3.0
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        s.reduce("sum", torch.tensor(3.0), axis=None)
    assert float(ts.MirroredStrategy(num_replicas=1).reduce("sum", torch.tensor(3.0), axis=None)) == 3.0


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_with_axis_over_uneven_and_empty_batches_uses_true_global_count(op):
    s = ts.MirroredStrategy(num_replicas=3)
    parts = [
        torch.arange(5.0, dtype=torch.float64).reshape(5, 1) * 3,
        torch.ones(2, 1, dtype=torch.float64),
        torch.zeros(0, 1, dtype=torch.float64),
    ]
    v = s.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])
    out = s.reduce(op, v, axis=0)
    full = torch.cat(parts)
    ref = full.sum(0) if op == "sum" else full.sum(0) / full.shape[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_reduce_mean_axis_none_of_per_replica_means_is_mean_of_components():
    s = ts.MirroredStrategy(num_replicas=2)
    v = PerReplica((torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])))
    torch.testing.assert_close(s.reduce("mean", v, axis=None), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(s.reduce("mean", v, axis=0), torch.tensor(3.0))
    torch.testing.assert_close(s.reduce("max", v, axis=None), torch.tensor([3.0, 6.0]))


def test_gather_and_all_gather(strategy):
    n = strategy.num_replicas_in_sync
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((ctx.replica_id_in_sync_group + 1, 2), float(ctx.replica_id_in_sync_group))
    )
    g = strategy.gather(v, axis=0)
    ref = torch.cat([torch.full((i + 1, 2), float(i)) for i in range(n)])
    torch.testing.assert_close(g, ref)
    out = strategy.run(lambda x: ts.get_replica_context().all_gather(x, axis=0), args=(v,))
    for comp in strategy.experimental_local_results(out):
        torch.testing.assert_close(comp, ref)


def test_all_reduce_in_replica_context_nested_and_distinct_results(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        x = torch.tensor(float(_rid() + 1))
        out = ts.get_replica_context().all_reduce("sum", {"a": x, "b": [x * 2]})
        out["a"].add_(100.0)  # each replica owns its result: no aliasing across replicas
        return out

    out = strategy.run(fn)
    total = n * (n + 1) / 2
    assert [float(t) for t in strategy.experimental_local_results(out["a"])] == [total + 100] * n
    assert [float(t) for t in strategy.experimental_local_results(out["b"][0])] == [2 * total] * n
    mean = strategy.run(lambda: ts.get_replica_context().all_reduce("mean", torch.tensor(float(_rid()))))
    assert {float(t) for t in strategy.experimental_local_results(mean)} == {(n - 1) / 2}


def test_extended_reduce_to_batch_reduce_to_and_update():
    s = ts.MirroredStrategy(num_replicas=2)
    v = PerReplica((torch.tensor(1.0), torch.tensor(5.0)))
    assert float(s.extended.reduce_to("sum", v, "cpu")) == 6.0
    m = s.extended.reduce_to("mean", v, v)
    assert isinstance(m, Mirrored) and [float(c) for c in m.values] == [3.0, 3.0]
    a, b = s.extended.batch_reduce_to("sum", [(v, "cpu"), (v, v)])
    assert float(a) == 6.0 and [float(c) for c in b.values] == [6.0, 6.0]
    with pytest.raises(ValueError, match="destinations"):
        s.extended.reduce_to("sum", v, 3)
    with s.scope():
        var = ts.Variable(torch.zeros(2))
    s.extended.update(var, lambda c, x: c.assign_add(x), args=(torch.ones(2),))  # fn gets a variable, as in TF
    assert all(torch.equal(c, torch.ones(2)) for c in var.values)
    with pytest.raises(RuntimeError, match="merge_call"):
        s.run(lambda: s.extended.reduce_to("sum", v, "cpu"))


def test_distribute_values_from_function():
    s = ts.MirroredStrategy(num_replicas=3)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert s.experimental_local_results(v) == ((0, 3), (1, 3), (2, 3))
    with pytest.raises(TypeError, match="callable"):
        s.experimental_distribute_values_from_function(5)


def test_grad_mode_of_the_caller_reaches_replicas():
    s = ts.MirroredStrategy(num_replicas=2)
    with torch.no_grad():
        out = s.run(lambda: torch.is_grad_enabled())
    assert s.experimental_local_results(out) == (False, False) or out is False
    assert s.run(lambda: torch.is_grad_enabled()) is True


def test_experimental_set_strategy_with_mirrored():
    s = ts.MirroredStrategy(num_replicas=2)
    ts.experimental_set_strategy(s)
    try:
        assert ts.get_strategy() is s and ts.in_cross_replica_context()
    finally:
        ts.experimental_set_strategy(None)
    assert not ts.has_strategy()
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not be called inside"):
            ts.experimental_set_strategy(ts.MirroredStrategy(num_replicas=2))


def test_nccl_and_hierarchical_copy_fall_back_on_cpu_with_a_warning():
    for cls in (ts.NcclAllReduce, ts.HierarchicalCopyAllReduce):
        s = ts.MirroredStrategy(num_replicas=2, cross_device_ops=cls(num_packs=2))
        v = PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
        with pytest.warns(RuntimeWarning, match="falling back to ReductionToOneDevice"):
            assert float(s.reduce("sum", v, axis=None)) == 3.0
        with pytest.raises(ValueError, match="num_packs >= 0"):
            cls(num_packs=-1)


@pytest.mark.timeout(30)
def test_merge_call_timeout_turns_a_stuck_replica_into_deadline_exceeded():
    import threading

    s = ts.MirroredStrategy(num_replicas=2)
    s.extended.merge_call_timeout = 0.2
    release = threading.Event()

    def fn():
        if _rid() == 1:
            release.wait(10)  # stuck until the test lets it go
        return ts.get_replica_context().merge_call(lambda strategy: 1)

    try:
        with pytest.raises(ts.errors.DeadlineExceededError, match="Replica 1 neither finished nor reached"):
            s.run(fn)
    finally:
        release.set()
    s.extended.merge_call_timeout = None
    assert s.experimental_local_results(s.run(lambda: _rid())) == (0, 1)


def test_merge_call_outside_its_replica_raises():
    s = ts.MirroredStrategy(num_replicas=2)
    ctxs = s.run(lambda: ts.get_replica_context())
    with pytest.raises(RuntimeError, match="must be called in this replica's context"):
        s.experimental_local_results(ctxs)[0].merge_call(lambda strategy: None)
