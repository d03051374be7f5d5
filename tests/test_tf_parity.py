"""Behaviour that a side-by-side run against TensorFlow 2.21 found different (issue #16); TF is the target.

Each test states TF 2.21's result (MirroredStrategy over 2 logical CPUs) and checks ours against it.
"""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import replica_id as _rid
from torchstrategies.distribute.device_util import canonicalize

AGG = ts.VariableAggregation


@pytest.fixture
def s2():
    return ts.MirroredStrategy(num_replicas=2)


def _floats(values):
    return tuple(float(v) for v in values)


# 1. ON_WRITE, aggregation NONE, written inside run: each replica writes its own component.
def test_step_counter_with_default_aggregation_increments_inside_run(s2):
    with s2.scope():
        step = ts.Variable(0)  # TF: tf.Variable(0) -> ON_WRITE (AUTO), aggregation NONE
    for _ in range(3):
        s2.run(lambda: step.assign_add(1))
    assert int(step) == 3
    assert _floats(s2.experimental_local_results(step)) == (3.0, 3.0)


def test_on_write_none_replica_writes_diverge_and_cross_replica_read_gives_component_0(s2):
    with s2.scope():
        v = ts.Variable(0.0)
    seen = s2.run(lambda: v.assign(10.0 * (_rid() + 1)).read_value())
    assert _floats(s2.experimental_local_results(seen)) == (10.0, 20.0)  # each replica reads its own
    assert _floats(s2.experimental_local_results(v)) == (10.0, 20.0)
    assert float(v) == 10.0 and float(v.read_value()) == 10.0
    v.assign(1.0)  # cross-replica: every component again
    assert _floats(s2.experimental_local_results(v)) == (1.0, 1.0)


# 2. experimental_local_results(variable) gives the components.
@pytest.mark.parametrize("agg,expected", [(AGG.SUM, (3.0, 3.0)), (AGG.MEAN, (6.0, 6.0))])
def test_local_results_of_an_on_read_variable_are_its_components(s2, agg, expected):
    with s2.scope():
        v = ts.Variable(0.0, synchronization=ts.VariableSynchronization.ON_READ, aggregation=agg)
    v.assign(6.0)
    results = s2.experimental_local_results(v)
    assert isinstance(results, tuple) and _floats(results) == expected
    assert float(v.read_value()) == 6.0


def test_local_results_of_a_plain_variable_is_the_variable():
    v = ts.Variable(2.0)
    assert ts.get_strategy().experimental_local_results(v) == (v,)


# 3. TF device names wherever a destination or device is.
@pytest.mark.parametrize(
    "destination", ["/cpu:0", "/CPU:1", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"]
)
def test_reduce_to_accepts_tf_device_strings(s2, destination):
    v = ts.PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
    assert float(s2.extended.reduce_to("sum", v, destination)) == 3.0
    out = s2.extended.batch_reduce_to("mean", [(v, destination), (v, [destination, "/cpu:1"])])
    assert float(out[0]) == 1.5 and _floats(out[1].values) == (1.5, 1.5)
    assert float(ts.get_strategy().extended.reduce_to("sum", torch.tensor(4.0), destination)) == 4.0
    reduced = ts.ReductionToOneDevice(reduce_to_device=destination).reduce("sum", v, destination)
    assert float(reduced) == 3.0


def test_tf_device_names_resolve_to_torch_devices():
    assert canonicalize("/gpu:1") == ("cuda:1", torch.device("cuda", 1))
    assert canonicalize("/job:localhost/replica:0/task:0/device:GPU:0") == ("cuda:0", torch.device("cuda", 0))
    assert canonicalize("/device:CPU:3") == ("cpu:3", torch.device("cpu"))
    with pytest.raises(ValueError, match="Invalid device '/job:worker/task:1/device:CPU:0'.*job must be"):
        canonicalize("/job:worker/task:1/device:CPU:0")
    with pytest.raises(ValueError, match="Invalid device '/cpu:0/gpu:1'.*two devices"):
        canonicalize("/cpu:0/gpu:1")


def test_reduce_to_of_a_plain_tensor_is_tfs_value_error(s2):
    with pytest.raises(ValueError, match=r"A non-DistributedValues value tensor\(1\.\) cannot be reduced"):
        s2.extended.reduce_to(ts.ReduceOp.SUM, torch.tensor(1.0), "/cpu:0")


# 5. ON_READ with aggregation NONE has no cross-replica value: TF's ValueError for reads and writes.
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_cross_replica_write_of_on_read_none_variable_raises(s2, method):
    with s2.scope():
        v = ts.Variable(1.0, synchronization=ts.VariableSynchronization.ON_READ)
    with pytest.raises(
        ValueError, match="Could not convert from `tf.VariableAggregation` VariableAggregation.NONE to"
    ):
        getattr(v, method)(5.0)
    assert _floats(v.values) == (1.0, 1.0)  # refused before writing
    s2.run(lambda: getattr(v, method)(2.0))  # replica context: each writes its own, as before
    assert (
        _floats(v.values)
        == {"assign": (2.0, 2.0), "assign_add": (3.0, 3.0), "assign_sub": (-1.0, -1.0)}[method]
    )


# 6. Exception classes of the loss helpers follow TF where TF's is a builtin.
def test_compute_average_loss_non_integer_global_batch_size_is_type_error():
    loss = torch.ones(4)
    for bad in (2.5, torch.tensor(4.0), True, "4"):
        with pytest.raises(TypeError, match="global_batch_size must be an integer"):
            ts.compute_average_loss(loss, global_batch_size=bad)
    with pytest.raises(ValueError, match="global_batch_size must be scalar"):
        ts.compute_average_loss(loss, global_batch_size=[4, 4])
    with pytest.raises(ValueError, match="global_batch_size must be positive"):
        ts.compute_average_loss(loss, global_batch_size=0)
    with pytest.raises(ValueError, match="at least rank 1"):
        ts.compute_average_loss(torch.tensor(1.0), global_batch_size=1)


def test_compute_average_loss_sample_weight_shapes_follow_tf():
    loss = torch.tensor([1.0, 2.0, 3.0])
    # (batch, 1) weights are squeezed (before: broadcast to (3, 3), nine terms summed).
    w = torch.tensor([[1.0], [0.0], [2.0]])
    assert float(ts.compute_average_loss(loss, sample_weight=w, global_batch_size=3)) == pytest.approx(7 / 3)
    # A weight per example for a (batch, k) loss gets a last dim of 1.
    loss2 = torch.ones(3, 2)
    assert float(
        ts.compute_average_loss(loss2, sample_weight=torch.tensor([1.0, 0.0, 1.0]), global_batch_size=3)
    ) == (pytest.approx(4 / 3))
    with pytest.raises(ValueError, match=r"Can not squeeze dim\[1\], expected a dimension of 1, got 3"):
        ts.compute_average_loss(loss, sample_weight=torch.ones(2, 3), global_batch_size=3)
    with pytest.raises(ValueError, match=r"sample_weight of shape \(2,\) does not broadcast"):
        ts.compute_average_loss(loss, sample_weight=torch.ones(2), global_batch_size=3)
