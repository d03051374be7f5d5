"""MirroredStrategy / CentralStorage with a CUDA device (skipped without a GPU; failing instead when
TORCHSTRATEGIES_TEST_GPU=1)."""

from __future__ import annotations

import os

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import batches, train


@pytest.fixture(autouse=True)
def _need_gpu():
    if not torch.cuda.is_available():
        if os.environ.get("TORCHSTRATEGIES_TEST_GPU") == "1":
            pytest.fail("TORCHSTRATEGIES_TEST_GPU=1 but CUDA is not available")
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make",
    [
        lambda: ts.MirroredStrategy(["cuda:0"]),
        lambda: ts.MirroredStrategy(["cuda:0", "cpu:0"]),
        lambda: ts.CentralStorageStrategy(["cuda:0", "cpu:0"], parameter_device="cpu"),
        lambda: ts.OneDeviceStrategy("cuda:0"),
    ],
    ids=["mirrored-gpu", "mirrored-gpu+cpu", "central-cpu-params", "one-device-gpu"],
)
def test_gpu_strategies_match_cpu_training(make):
    ref = train(None, "adam", batches(12))
    got = train(make(), "adam", batches(12))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-10)


@pytest.mark.gpu
def test_nccl_all_reduce_on_one_gpu():
    ops = ts.NcclAllReduce()
    v = ts.PerReplica((torch.ones(3, device="cuda:0"),))
    torch.testing.assert_close(ops.reduce("sum", v, "cuda:0").cpu(), torch.ones(3))
