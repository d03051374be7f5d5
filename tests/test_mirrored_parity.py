"""The heart: N CPU replicas (and CentralStorage) with global batch B give the same parameters as one device
with batch B, for every AggregationMethod and for SGD and Adam."""

from __future__ import annotations

import itertools

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import batches, make_model, train


@pytest.fixture(scope="module")
def references():
    return {(b, o): train(None, o, batches(b)) for b, o in itertools.product((12, 10), ("sgd", "adam"))}


def _assert_same(got, ref):
    init = [p.detach() for p in make_model().parameters()]
    # training really moved the weights
    assert any(not torch.allclose(r, i) for r, i in zip(ref, init, strict=False))
    for g, r in zip(got, ref, strict=False):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("method", list(ts.AggregationMethod)[:3], ids=lambda m: m.name)
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("global_batch", [12, 10], ids=["even", "uneven"])
def test_mirrored_replicas_match_single_device_training(references, method, replicas, opt_name, global_batch):
    s = ts.MirroredStrategy(
        num_replicas=replicas, cross_device_ops=ts.ReductionToOneDevice(accumulation_fn=method)
    )
    _assert_same(train(s, opt_name, batches(global_batch)), references[(global_batch, opt_name)])


@pytest.mark.parametrize("method", list(ts.AggregationMethod)[:3], ids=lambda m: m.name)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_central_storage_matches_single_device_training(references, method, opt_name):
    s = ts.CentralStorageStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], "cpu", cross_device_ops=ts.ReductionToOneDevice("cpu", method)
    )
    _assert_same(train(s, opt_name, batches(12)), references[(12, opt_name)])


def test_callable_accumulation_fn_and_one_device_match_too(references):
    calls = []

    def my_sum(tensors):
        calls.append(len(tensors))
        return torch.stack(tensors).sum(0)

    s = ts.MirroredStrategy(num_replicas=2, cross_device_ops=ts.ReductionToOneDevice(accumulation_fn=my_sum))
    _assert_same(train(s, "adam", batches(12)), references[(12, "adam")])
    assert calls and set(calls) == {2}
    _assert_same(train(ts.OneDeviceStrategy("cpu"), "sgd", batches(12)), references[(12, "sgd")])
