"""ts.Variable under MirroredStrategy: TF's assign/aggregation table and sync-on-read rules (ported from
TF's mirrored_variable_test and values_test)."""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import replica_id as _rid
from torchstrategies.distribute.variables import MirroredVariable, SyncOnReadVariable

AGG = ts.VariableAggregation


@pytest.fixture
def s3():
    return ts.MirroredStrategy(num_replicas=3)


def _comps(v):
    return [float(c) for c in v.values]


def test_local_variable_outside_scope():
    v = ts.Variable(torch.tensor([1.0, 2.0]), name="v")
    v.assign_add(torch.ones(2)).assign_sub(0.5)
    torch.testing.assert_close(v.read_value(), torch.tensor([1.5, 2.5]))
    assert v.numpy().tolist() == [1.5, 2.5] and v.trainable and v.name == "v"
    torch.testing.assert_close(torch.mul(v, 2), torch.tensor([3.0, 5.0]))
    torch.testing.assert_close(v @ torch.ones(2), torch.tensor(4.0))
    assert ts.Variable(lambda: torch.zeros(3)).shape == (3,)
    with pytest.raises(ValueError, match="initial_value"):
        ts.Variable(None)
    with pytest.raises(ValueError, match="Invalid variable aggregation"):
        ts.Variable(1.0, aggregation="median")
    with pytest.raises(ValueError, match="Invalid variable synchronization"):
        ts.Variable(1.0, synchronization="sometimes")


def test_variables_in_scope_are_distributed_one_component_per_replica(s3):
    with s3.scope():
        w = ts.Variable(torch.ones(2))
        r = ts.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert isinstance(w, MirroredVariable) and isinstance(r, SyncOnReadVariable)
    assert len(w.values) == 3 and w.values[0] is not w.values[1]
    assert s3.extended.variable_created_in_scope(w) and not r.trainable
    assert not s3.extended.variable_created_in_scope(ts.Variable(1.0))


def test_creation_errors_none_synchronization_and_integer_mean(s3):
    with s3.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not supported"):
            ts.Variable(1.0, synchronization=ts.VariableSynchronization.NONE, name="x")
        with pytest.raises(ValueError, match="MEAN is not supported for the integer variable 'c'"):
            ts.Variable(torch.tensor(1), aggregation=AGG.MEAN, name="c")
        ts.Variable(torch.tensor(1), aggregation=AGG.SUM)  # fine


def test_mirrored_assign_in_cross_replica_context_writes_every_component(s3):
    with s3.scope():
        v = ts.Variable(1.0)
    v.assign(5.0)
    assert _comps(v) == [5.0] * 3
    v.assign_add(2.0)
    v.assign_sub(1.0)
    assert _comps(v) == [6.0] * 3 and float(v) == 6.0


def test_central_storage_assign_with_aggregation_none_in_replica_context_raises():
    # One copy shared by every replica: TF's AggregatingVariable refuses the write (Mirrored accepts it,
    # see tests/test_tf_parity.py).
    s = ts.CentralStorageStrategy(["cpu:0", "cpu:1"])
    with s.scope():
        v = ts.Variable(1.0)
    with pytest.raises(
        ValueError, match="You must specify an aggregation method to update a AggregatingVariable"
    ):
        s.run(lambda: v.assign(5.0))
    assert float(v) == 1.0


def test_mirrored_assign_plain_value_with_sum_from_several_replicas_raises(s3):
    with s3.scope():
        v = ts.Variable(1.0, aggregation=AGG.SUM)
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        s3.run(lambda: v.assign(5.0))


@pytest.mark.parametrize(
    "agg,method,expected",
    [
        (AGG.SUM, "assign", 1.0 + 2.0 + 3.0),
        (AGG.MEAN, "assign", 2.0),
        (AGG.ONLY_FIRST_REPLICA, "assign", 1.0),
        (AGG.SUM, "assign_add", 10.0 + 6.0),
        (AGG.MEAN, "assign_add", 10.0 + 2.0),
        (AGG.ONLY_FIRST_REPLICA, "assign_add", 10.0 + 1.0),
        (AGG.SUM, "assign_sub", 10.0 - 6.0),
        (AGG.MEAN, "assign_sub", 10.0 - 2.0),
    ],
)
def test_mirrored_assign_in_replica_context_aggregates_per_replica_values(s3, agg, method, expected):
    with s3.scope():
        v = ts.Variable(10.0, aggregation=agg)
    s3.run(lambda: getattr(v, method)(torch.tensor(float(_rid() + 1))))
    assert _comps(v) == [expected] * 3


def test_mirrored_mean_and_only_first_accept_the_same_plain_value(s3):
    with s3.scope():
        m = ts.Variable(1.0, aggregation=AGG.MEAN)
        f = ts.Variable(1.0, aggregation=AGG.ONLY_FIRST_REPLICA)
    s3.run(lambda: (m.assign(4.0), f.assign_add(1.0)))
    assert _comps(m) == [4.0] * 3 and _comps(f) == [2.0] * 3


def test_mirrored_read_in_replica_context_gives_the_replica_component(s3):
    with s3.scope():
        v = ts.Variable(3.0, aggregation=AGG.MEAN)
    out = s3.run(lambda: v.read_value() * (_rid() + 1))
    assert [float(x) for x in s3.experimental_local_results(out)] == [3.0, 6.0, 9.0]


@pytest.mark.parametrize("agg,expected", [(AGG.SUM, 6.0), (AGG.MEAN, 2.0), (AGG.ONLY_FIRST_REPLICA, 1.0)])
def test_sync_on_read_replica_writes_are_local_and_cross_replica_read_aggregates(s3, agg, expected):
    with s3.scope():
        v = ts.Variable(0.0, synchronization="on_read", aggregation=agg)
    out = s3.run(lambda: v.assign_add(torch.tensor(float(_rid() + 1))).read_value())
    assert [float(x) for x in s3.experimental_local_results(out)] == [1.0, 2.0, 3.0]  # local reads
    assert float(v.read_value()) == expected
    assert _comps(v) == [1.0, 2.0, 3.0]  # reading does not change the components


def test_sync_on_read_sum_cross_replica_assign_divides_and_add_raises(s3):
    with s3.scope():
        v = ts.Variable(0.0, synchronization="on_read", aggregation=AGG.SUM)
    v.assign(6.0)
    assert _comps(v) == [2.0] * 3 and float(v.read_value()) == 6.0
    for op in ("assign_add", "assign_sub"):
        with pytest.raises(
            ValueError, match=f"SyncOnReadVariable does not support `{op}` in cross-replica context"
        ):
            getattr(v, op)(1.0)


def test_sync_on_read_mean_cross_replica_assign_add_applies_to_each(s3):
    with s3.scope():
        v = ts.Variable(1.0, synchronization="on_read", aggregation=AGG.MEAN)
    v.assign_add(2.0)
    assert _comps(v) == [3.0] * 3 and float(v.read_value()) == 3.0


def test_sync_on_read_none_aggregation_cannot_be_read_cross_replica(s3):
    with s3.scope():
        v = ts.Variable(1.0, synchronization="on_read")
    with pytest.raises(
        ValueError, match="Could not convert from `tf.VariableAggregation` VariableAggregation.NONE"
    ):
        v.read_value()


def test_one_device_variable_is_plain():
    s = ts.OneDeviceStrategy("cpu")
    with s.scope():
        v = ts.Variable(1.0, aggregation=AGG.SUM)
    s.run(lambda: v.assign(3.0))
    assert float(v) == 3.0 and len(v.values) == 1
