"""MultiWorkerMirroredStrategy's one seam (issue 26): ONE torch ProcessGroup carries all of its cross-worker
traffic, through public torch.distributed calls; ``implementation`` picks that group through one function;
gradients go through one DDP-style hook; a worker that runs out of data early ends in a named error."""

from __future__ import annotations

import pytest
import torch

from tests._mw_common import assert_params_close, make_data, make_model, params_of, reference_params, shard
from tests.harness import run_ranks

_CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor", "barrier",
          "reduce_scatter", "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list", "send", "recv")


def _record_dist_calls(log: list):
    """Wraps the torch.distributed collectives to log (name, group) of every call."""
    import torch.distributed as dist

    for name in _CALLS:
        orig = getattr(dist, name)

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            log.append((_name, kwargs.get("group")))
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapper)


def _forbid_our_collectives():
    """Any call into torchstrategies.collectives' reduction functions fails: the group is the only path."""
    import torchstrategies.collectives as C
    from torchstrategies.collectives import api

    def forbidden(*args, **kwargs):
        raise AssertionError("MultiWorkerMirroredStrategy called torchstrategies.collectives directly")

    for name in ("all_reduce", "all_reduce_", "all_reduce_async", "all_gather", "broadcast", "buffer"):
        for mod in (C, api):
            if hasattr(mod, name):
                setattr(mod, name, forbidden)


def _everything_through_one_group(rank, world):
    import os
    import tempfile

    import torch.distributed as dist

    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy, allreduce_hook

    s = MultiWorkerMirroredStrategy()  # makes its group (how the group is set up is the backend's business)
    group = s.extended.process_group
    log: list = []
    _record_dist_calls(log)
    _forbid_our_collectives()
    out = {"backend": dist.get_backend(group), "not_world": group is not dist.group.WORLD}

    seen = []

    def counting_hook(state, bucket):
        seen.append((bucket.index(), state is group))
        return allreduce_hook(state, bucket)

    with s.scope():  # broadcast of the initial values
        model = make_model(0)
        bn = ts.nn.SyncBatchNorm(3)
        opt = torch.optim.SGD(list(model.parameters()) + list(bn.parameters()), lr=0.1)
    s.extended.register_comm_hook(counting_hook)
    xs, ys = make_data()
    for k in range(xs.shape[0]):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(bn(model(x)), y, reduction="sum") / xs.shape[1]
            loss.backward()  # SyncBatchNorm forward + backward and the gradient buckets
            opt.step()
            opt.zero_grad()
            return loss

        s.reduce("sum", s.run(step, args=(shard(xs[k], rank, world), shard(ys[k], rank, world))), axis=None)
    x = torch.tensor([float(rank + 1), 2.0])
    out["gather"] = s.gather(torch.full((rank + 1, 2), float(rank)), axis=0).tolist()
    out["reduce_to"] = s.extended.reduce_to("max", x, "cpu").tolist()
    out["batch"] = [t.tolist() for t in s.extended.batch_reduce_to("mean", [(x, "cpu"), (x * 2, "cpu")])]
    out["ctx"] = s.run(lambda: ts.get_replica_context().all_reduce("sum", torch.tensor(1.0))).item()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4,
                                         shuffle=True)  # no generator: rank 0's seed is broadcast
    out["batches"] = len(list(s.experimental_distribute_dataset(loader)))
    with tempfile.TemporaryDirectory() as d:
        Checkpoint(model=bn, step=1).save(os.path.join(d, "c.pt"))  # buffer means + barrier
    before = len(log)  # bytes_per_pack (the strategy's, or a call's own) cuts the packs: one call per pack
    s.extended.batch_reduce_to("sum", [(x, "cpu"), (x, "cpu")], options=ts.CommunicationOptions(bytes_per_pack=8))
    out["calls_8_byte_packs"] = len(log) - before
    before = len(log)
    s.extended.batch_reduce_to("sum", [(x, "cpu"), (x, "cpu")])
    out["calls_one_pack"] = len(log) - before
    y = torch.tensor([float(rank + 1), 4.0])
    pending = s.extended.all_reduce_tensors_async("mean", [y])   # (the agreement check's way: started now)
    y.fill_(100.0)   # the input was copied when the all-reduce started
    out["async_mean"] = [pending.wait()[0].tolist(), pending.wait()[0].tolist()]
    ours = list(log)
    per_call_groups = []
    for impl in ("GLOO", "GLOO", "AUTO"):
        before = len(log)
        s.extended.reduce_to("sum", x, "cpu", options=ts.CommunicationOptions(implementation=impl))
        per_call_groups.append([g for n, g in log[before:] if n == "all_reduce"][-1])
    out["gloo_call_group_backend"] = dist.get_backend(per_call_groups[0])
    out["gloo_call_group_is_strategy_group"] = per_call_groups[0] is group
    out["gloo_group_made_once"] = per_call_groups[0] is per_call_groups[1]
    out["auto_call_group_is_strategy_group"] = per_call_groups[2] is group
    out["names"] = sorted({n for n, _ in ours})
    out["other_groups"] = [n for n, g in ours if g is not group]
    out["hooks"] = seen
    out["synchronizers"] = len(s.extended.gradient_synchronizers)
    out["params"] = params_of(model)
    s.shutdown()
    return out


@pytest.mark.timeout(120)
def test_every_cross_worker_call_goes_through_the_strategys_one_process_group():
    res = run_ranks(_everything_through_one_group, 2, init_process_group=False, timeout=110)
    for out in res:
        assert out["not_world"]  # the strategy's own group, made by the one function
        assert out["other_groups"] == [], out["other_groups"]  # nothing on the default group or another one
        assert {"all_reduce", "broadcast", "all_gather_single", "barrier"} <= set(out["names"]), out["names"]
        assert out["synchronizers"] == 2  # the model and the batch norm, two root modules
        assert out["hooks"] == [(0, True)] * 6  # one bucket each per step, three steps, the group as state
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["reduce_to"] == [2.0, 2.0]
        assert out["batch"] == [[1.5, 2.0], [3.0, 4.0]]
        assert out["ctx"] == 2.0
        assert out["batches"] == 2
        assert (out["calls_8_byte_packs"], out["calls_one_pack"]) == (2, 1)
        assert out["async_mean"] == [[1.5, 4.0], [1.5, 4.0]]   # waited once, the same tensors again
        # a call's own implementation gets a group of that kind, made once; the strategy's own serves AUTO
        assert out["gloo_call_group_backend"] == "gloo"
        assert out["gloo_group_made_once"] and out["auto_call_group_is_strategy_group"]
    assert res[0]["params"] is not None
    for p, q in zip(res[0]["params"], res[1]["params"]):
        assert (p == q).all()


def _implementation_picks_the_group(rank, world):
    import torch.distributed as dist

    import torchstrategies as ts
    from torchstrategies.distribute import collective_all_reduce
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    made = []
    orig = collective_all_reduce._make_group

    def recording(options):
        g = orig(options)
        made.append((options.implementation.name, options.timeout_seconds, g))
        return g

    collective_all_reduce._make_group = recording
    out = {}
    for impl in ("AUTO", "SHM", "GLOO"):
        s = MultiWorkerMirroredStrategy(ts.CommunicationOptions(implementation=impl, timeout_seconds=30))
        name, timeout, g = made[-1]
        out[impl] = (name, timeout, g is s.extended.process_group, s.reduce("sum", torch.ones(1)).item())
        s.shutdown()
    # a group the user made is adopted as it is: nothing is made, everything goes through it
    mine = dist.new_group(backend="gloo")
    n = len(made)
    s = MultiWorkerMirroredStrategy(process_group=mine)
    with s.scope():
        model = make_model(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = make_data()
    for k in range(xs.shape[0]):
        (torch.nn.functional.cross_entropy(model(shard(xs[k], rank, world)), shard(ys[k], rank, world),
                                           reduction="sum") / xs.shape[1]).backward()
        opt.step()
        opt.zero_grad()
    out["adopted"] = (s.extended.process_group is mine, len(made) - n)
    out["params"] = params_of(model)
    s.shutdown()
    try:
        MultiWorkerMirroredStrategy(ts.CommunicationOptions(implementation="GLOO"), process_group=mine)
        out["both"] = "no error"
    except ValueError as exc:
        out["both"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_implementation_picks_the_group_through_one_function_and_a_users_group_is_adopted():
    res = run_ranks(_implementation_picks_the_group, 2, timeout=110)
    want = reference_params()
    for out in res:
        for impl in ("AUTO", "SHM", "GLOO"):
            assert out[impl] == (impl, 30, True, 2.0), out[impl]
        assert out["adopted"] == (True, 0)
        assert_params_close(out["params"], want, what="adopted group")
        assert "process_group or communication_options.implementation (GLOO)" in out["both"], out["both"]


def _uneven_data(rank, world, backend_file):
    import torch.distributed as dist

    import torchstrategies as ts
    from torchstrategies.errors import DeadlineExceededError, UnavailableError
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy(ts.CommunicationOptions(timeout_seconds=20))
    if rank == 0:
        with open(backend_file, "w") as f:
            f.write(dist.get_backend(s.extended.process_group))
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
def test_uneven_data_per_worker_ends_every_worker_with_a_named_mismatch_error(tmp_path):
    backend_file = str(tmp_path / "backend")
    res = run_ranks(_uneven_data, 2, args=(backend_file,), init_process_group=False, timeout=110,
                    expect_failure=[0, 1])  # ends, one way or another, within the timeout: never a hang
    # The default strategy runs on our backend, whose call check names the mismatch (gloo has none: it
    # aborts a process on a size mismatch).
    assert open(backend_file).read() == "torchstrategies"
    for rank, r in enumerate(res):
        assert isinstance(r, tuple), (rank, r)
        kind, msg = r
        assert kind == "ValueError", (rank, kind, msg)
        assert "mismatch" in msg, msg
