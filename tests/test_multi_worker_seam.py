"""MultiWorkerMirroredStrategy's one seam (issue 14): every reduction goes through its CollectiveAllReduce and
honours CommunicationOptions.implementation; gradients go through one comm hook; a worker that runs out of
data early makes the workers fail with a named error, not a timeout."""

from __future__ import annotations

import pytest
import torch

from tests._mw_common import assert_params_close, make_data, make_model, params_of, reference_params, shard
from tests.harness import run_ranks


def _count_native(calls: dict):
    """Counts the all-reduces that run on gloo (torch's own backend), not on the torchstrategies backend."""
    from torchstrategies.collectives import api

    orig = api._allreduce

    def counting(target, *args, **kwargs):
        if not target.ours:
            calls["n"] += 1
        return orig(target, *args, **kwargs)

    api._allreduce = counting


def _reduce_honours_implementation(rank, world):
    import torchstrategies as ts
    from torchstrategies.distribute.collective_all_reduce import allreduce_hook
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    out = {}
    calls = {"n": 0}
    _count_native(calls)
    s = MultiWorkerMirroredStrategy(ts.CommunicationOptions(implementation="SHM"))
    x = torch.tensor([float(rank + 1), 2.0])
    before = calls["n"]
    out["shm_sum"] = s.reduce("sum", x).tolist()
    out["shm_native_calls"] = calls["n"] - before
    gloo = ts.CommunicationOptions(implementation="GLOO")
    before = calls["n"]
    out["gloo_sum"] = s.extended.reduce_to("sum", x, None, options=gloo).tolist()
    out["gloo_native_calls"] = calls["n"] - before
    out["gather"] = s.gather(torch.full((rank + 1, 2), float(rank)), axis=0).tolist()
    out["cdo"] = type(s.extended.cross_device_ops).__name__

    # gradients through one hook: count the buckets the hook sees; training still matches the reference
    seen = []

    def counting_hook(state, bucket):
        seen.append(bucket.index())
        return allreduce_hook(state, bucket)

    with s.scope():
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.extended.register_comm_hook(counting_hook)
    xs, ys = make_data()
    for k in range(xs.shape[0]):
        loss = torch.nn.functional.cross_entropy(model(shard(xs[k], rank, world)), shard(ys[k], rank, world),
                                                 reduction="sum") / xs.shape[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
    out["hook_calls"] = len(seen)
    out["params"] = params_of(model)
    s.shutdown()
    return out


@pytest.mark.timeout(120)
def test_every_reduction_goes_through_collective_all_reduce_and_honours_the_implementation():
    res = run_ranks(_reduce_honours_implementation, 2, init_process_group=False, timeout=110)
    want = reference_params()
    for out in res:
        assert out["cdo"] == "CollectiveAllReduce"
        assert out["shm_sum"] == [3.0, 4.0] and out["shm_native_calls"] == 0, out
        assert out["gloo_sum"] == [3.0, 4.0] and out["gloo_native_calls"] >= 1, out
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["hook_calls"] == 3  # one bucket, three steps
        assert_params_close(out["params"], want, what="hooked training")


def _uneven_data(rank, world):
    import torchstrategies as ts
    from torchstrategies.errors import DeadlineExceededError, UnavailableError
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy(ts.CommunicationOptions(timeout_seconds=60))
    with s.scope():
        model = make_model(0)
    steps = 2 if rank == 0 else 4  # worker 0 has less data
    xs, ys = make_data(steps=4)
    try:
        for k in range(steps):
            loss = torch.nn.functional.cross_entropy(model(shard(xs[k], rank, world)), shard(ys[k], rank, world))
            loss.backward()
        s.reduce("sum", torch.ones(1))  # end of epoch: a metric
        result = ("no error", "")
    except (ValueError, UnavailableError, DeadlineExceededError) as exc:
        result = (type(exc).__name__, str(exc))
    return result


@pytest.mark.timeout(120)
def test_uneven_data_per_worker_ends_every_worker_with_a_named_mismatch_error():
    res = run_ranks(_uneven_data, 2, init_process_group=False, timeout=110)
    for rank, (kind, msg) in enumerate(res):
        assert kind == "ValueError", (rank, kind, msg)
        assert "mismatch" in msg, msg
