"""MultiWorkerMirroredStrategy semantics: no_sync, unused parameters, repeated backward, compression, reduce,
gather, input sharding and errors; one spawned group of 2 workers runs all the checks."""

from __future__ import annotations

import pytest
import torch

from tests._mw_common import IN, OUT, assert_params_close, make_data, make_model, shard
from tests.harness import run_ranks


def _strategy(**kw):
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    return MultiWorkerMirroredStrategy(**kw)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone().numpy() for p in model.parameters()]


def _check_no_sync(rank, world):
    """k micro-batches under no_sync + one synced = one big batch (and no communication under no_sync)."""
    s = _strategy()
    with s.scope():
        model = make_model(rank)
    xs, ys = make_data(steps=4, global_batch=8)
    sync = s.extended.gradient_synchronizers[0]
    before = sync.num_reductions
    with s.extended.no_sync():
        for k in range(3):
            (torch.nn.functional.cross_entropy(model(shard(xs[k], rank, world)), shard(ys[k], rank, world),
                                               reduction="sum") / 32).backward()
    assert sync.num_reductions == before, "no_sync communicated"
    (torch.nn.functional.cross_entropy(model(shard(xs[3], rank, world)), shard(ys[3], rank, world),
                                       reduction="sum") / 32).backward()
    out = _grads(model)
    s.shutdown()
    return out


def _check_unused(rank, world):
    """A layer used only on rank 0, a layer used by nobody: no hang, rank 0's gradient arrives everywhere,
    the unused one stays None."""
    s = _strategy()
    with s.scope():
        torch.manual_seed(0)
        used = torch.nn.Linear(IN, OUT)
        only0 = torch.nn.Linear(IN, OUT)
        never = torch.nn.Linear(IN, OUT)
        model = torch.nn.ModuleList([used, only0, never])
    x = torch.full((2, IN), float(rank + 1))
    loss = used(x).sum()
    if rank == 0:
        loss = loss + only0(x).sum()
    loss.backward()
    out = {
        "used_w": used.weight.grad.clone().numpy(),
        "only0_w": None if only0.weight.grad is None else only0.weight.grad.clone().numpy(),
        "never": [p.grad is None for p in never.parameters()],
    }
    del model
    s.shutdown()
    return out


def _check_backward_twice(rank, world):
    """Two synchronized backward passes before step() give the sum of both global gradients."""
    s = _strategy()
    with s.scope():
        model = make_model(0)
    xs, ys = make_data(steps=2, global_batch=8)
    for k in range(2):
        (torch.nn.functional.cross_entropy(model(shard(xs[k], rank, world)), shard(ys[k], rank, world),
                                           reduction="sum") / 8).backward()
    out = _grads(model)
    s.shutdown()
    return out


def _check_compression(rank, world, dtype):
    s = _strategy(gradient_compression=dtype)
    with s.scope():
        lin = torch.nn.Linear(64, 32, bias=False)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 64, generator=g) * 3
    w = torch.randn(16, 32, generator=g)
    (lin(x) * w).sum().backward()
    local = (w.t() @ x).double()  # this rank's exact gradient
    out = {"reduced": lin.weight.grad.clone().numpy(), "local": local.numpy()}
    s.shutdown()
    return out


def _check_reduce_gather(rank, world):
    import torchstrategies as ts
    from torchstrategies.distribute import get_replica_context

    s = _strategy()
    v = s.run(lambda: torch.tensor([float(rank + 1), 10.0 * (rank + 1)]))
    out = {
        "sum": s.reduce(ts.ReduceOp.SUM, v, axis=None).tolist(),
        "mean": s.reduce("mean", v, axis=None).tolist(),
        "max": s.reduce("max", v, axis=None).tolist(),
        # uneven batches: rank 0 has 1 row, rank 1 has 3 rows; MEAN over axis 0 divides by 4
        "mean_axis": s.reduce("mean", torch.ones(1 + 2 * rank, 2) * (rank + 1), axis=0).tolist(),
        "gather": s.gather(torch.full((1 + rank, 2), float(rank)), axis=0).tolist(),
        "replica_ids": s.run(lambda: get_replica_context().replica_id_in_sync_group),
        "ctx_all_reduce": s.run(lambda: get_replica_context().all_reduce("sum", torch.tensor(2.0))).item(),
    }
    s.shutdown()
    return out


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n, log):
        self.n = n
        self.log = log

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.log.append(i)
        return torch.tensor(i)


def _check_input(rank, world):
    s = _strategy()
    log = []
    loader = torch.utils.data.DataLoader(_Indexed(10, log), batch_size=4, shuffle=True)
    dd = s.experimental_distribute_dataset(loader)
    epoch0 = [b.tolist() for b in dd]
    read0 = sorted(log)
    epoch1 = [b.tolist() for b in dd]  # iterating again reshuffles (next epoch)
    dd.set_epoch(0)
    again0 = [b.tolist() for b in dd]
    seq = s.experimental_distribute_dataset(torch.utils.data.DataLoader(_Indexed(10, []), batch_size=4))
    seq_batches = [b.tolist() for b in seq]
    contexts = []

    def fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return [torch.tensor([ctx.input_pipeline_id])]

    from_fn = [b.tolist() for b in s.distribute_datasets_from_function(fn)]
    s.shutdown()
    return {"epoch0": epoch0, "read0": read0, "epoch1": epoch1, "again0": again0, "seq": seq_batches,
            "contexts": contexts, "from_fn": from_fn}


def _uneven_batches(rank):
    """Worker 0 holds 3 batches of 2 rows, worker 1 one batch of 3 rows (a fixed seed per worker)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2 if rank == 0 else 3, IN, generator=g) for _ in range(3 if rank == 0 else 1)]


def _train_uneven(s, model, make_iterable):
    """One epoch of SGD on per-worker input; returns the rows each step got and the final parameters."""
    def step(x):
        (model(x).pow(2).sum() / 5).backward()  # the loss of the global rows of a step over 5 (any constant)

    rows = []
    for batch in s.distribute_datasets_from_function(lambda ctx: make_iterable(_uneven_batches(ctx.input_pipeline_id))):
        rows.append(batch.shape[0])
        s.run(step, args=(batch,))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return rows, [p.detach().clone().numpy() for p in model.parameters()]


def _check_uneven(rank, world):
    """Per-worker input of different lengths ends the epoch on every worker at once (TF's rule): the worker
    whose data ran out gets empty batches; a worker with no batch at all makes every worker raise."""
    from torchstrategies.distribute.input_lib import InputExhaustedError

    s = _strategy()
    out = {}
    for key, make_iterable in (("known_len", list),  # len() known: the lengths are exchanged once
                               ("unknown_len", lambda bs: (b for b in bs))):  # a generator: a flag per step
        with s.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(IN, OUT)
        out[key] = _train_uneven(s, model, make_iterable)
    for name, make in (("known", list), ("unknown", iter)):
        try:
            for _ in s.distribute_datasets_from_function(
                    lambda ctx, make=make: make(_uneven_batches(0) if ctx.input_pipeline_id == 0 else [])):
                pass
            out[f"dry_{name}"] = "no error"
        except InputExhaustedError as exc:
            out[f"dry_{name}"] = str(exc)
    out["after"] = s.reduce("sum", torch.tensor(1.0), axis=None).item()  # the group still works
    s.shutdown()
    return out


def _check_plain_optimizer_beside(rank, world):
    """A torch optimizer over a model made outside the scope is left alone by the step pre-hook: its step
    does not communicate (only rank 0 steps it), keeps the local gradient and adds no synchronizer."""
    s = _strategy()
    with s.scope():
        torch.manual_seed(0)
        model = torch.nn.Linear(IN, OUT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = torch.nn.Linear(IN, OUT)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.full((2, IN), float(rank + 1))
    plain(x).sum().backward()
    local = plain.weight.grad.clone()
    if rank == 0:
        plain_opt.step()
    model(x).sum().backward()
    opt.step()
    out = {"local": bool(torch.equal(plain.weight.grad, local)), "syncs": len(s.extended.gradient_synchronizers),
           "model_grad": model.weight.grad.clone().numpy()}
    s.shutdown()
    return out


def _body(rank, world):
    return {
        "plain": _check_plain_optimizer_beside(rank, world),
        "no_sync": _check_no_sync(rank, world),
        "unused": _check_unused(rank, world),
        "twice": _check_backward_twice(rank, world),
        "fp16": _check_compression(rank, world, "float16"),
        "bf16": _check_compression(rank, world, "bfloat16"),
        "reduce": _check_reduce_gather(rank, world),
        "input": _check_input(rank, world),
        "uneven": _check_uneven(rank, world),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_body, 2, timeout=110)


def _global_grads(batches, global_batch):
    """float64 gradient of sum_k loss_k (each loss summed over its global batch / ``global_batch``)."""
    model = make_model(0).double()
    xs, ys = make_data(steps=4 if batches == 4 else 2, global_batch=8)
    for k in range(batches):
        (torch.nn.functional.cross_entropy(model(xs[k].double()), ys[k], reduction="sum") / global_batch).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.timeout(120)
def test_no_sync_accumulation_equals_one_big_batch(results):
    want = _global_grads(4, 32)
    for r in results:
        # rank seeds differed (0, 1): the broadcast made them rank 0's, i.e. make_model(0)
        assert_params_close(r["no_sync"], want, what="no_sync")


def test_parameters_without_gradient_on_some_rank_do_not_hang(results):
    x0, x1 = torch.full((2, IN), 1.0), torch.full((2, IN), 2.0)
    want_used = (x0.sum(0) + x1.sum(0)).expand(OUT, IN)
    for r in results:
        u = r["unused"]
        torch.testing.assert_close(torch.from_numpy(u["used_w"]), want_used)
        torch.testing.assert_close(torch.from_numpy(u["only0_w"]), x0.sum(0).expand(OUT, IN))  # rank 0's alone
        assert u["never"] == [True, True]


def test_an_optimizer_of_a_model_outside_the_strategy_is_left_alone(results):
    want = (torch.full((IN,), 1.0) + torch.full((IN,), 2.0)).expand(OUT, IN) * 2  # batch of 2 on each rank
    for r in results:
        p = r["plain"]
        assert p["local"] and p["syncs"] == 1, p
        torch.testing.assert_close(torch.from_numpy(p["model_grad"]), want)


def test_backward_twice_before_step_sums_both_global_gradients(results):
    want = _global_grads(2, 8)
    for r in results:
        assert_params_close(r["twice"], want, what="backward twice")


@pytest.mark.parametrize("key,u", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_compressed_all_reduce_stays_within_the_documented_bound(results, key, u):
    locals_ = [torch.from_numpy(r[key]["local"]) for r in results]
    exact = sum(locals_)
    abs_sum = sum(t.abs() for t in locals_)
    n = len(results)
    bound = u * abs_sum + n * 2.0**-24 * abs_sum + n * 2.0**-25
    for r in results:
        got = torch.from_numpy(r[key]["reduced"]).double()
        err = (got - exact).abs()
        assert (err <= bound).all(), f"{key}: max excess {(err - bound).max().item()}"
        assert err.max().item() > 0, f"{key}: no rounding at all, compression not applied?"
    assert (torch.from_numpy(results[0][key]["reduced"]) == torch.from_numpy(results[1][key]["reduced"])).all()


def test_reduce_gather_and_replica_context_across_workers(results):
    for rank, r in enumerate(results):
        rr = r["reduce"]
        assert rr["sum"] == [3.0, 30.0]
        assert rr["mean"] == [1.5, 15.0]
        assert rr["max"] == [2.0, 20.0]
        assert rr["mean_axis"] == pytest.approx([(1 * 1 + 3 * 2) / 4] * 2)
        assert rr["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert rr["replica_ids"] == rank
        assert rr["ctx_all_reduce"] == 4.0


def test_each_worker_reads_only_its_part_of_each_global_batch(results):
    a, b = results[0]["input"], results[1]["input"]
    # 10 samples, global batch 4, 2 workers: sizes 2,2 | 2,2 | 1,1 (the partial batch is spread evenly)
    assert [len(x) for x in a["epoch0"]] == [2, 2, 1]
    assert [len(x) for x in b["epoch0"]] == [2, 2, 1]
    both = sorted(sum(a["epoch0"], []) + sum(b["epoch0"], []))
    assert both == list(range(10))  # together one full epoch, no overlap
    assert a["read0"] == sorted(sum(a["epoch0"], []))  # worker 0 loaded only its own samples
    assert a["epoch1"] != a["epoch0"]  # reshuffled
    assert a["again0"] == a["epoch0"] and b["again0"] == b["epoch0"]  # set_epoch(0) replays epoch 0
    # global batch k is worker 0's part followed by worker 1's part
    for k in range(3):
        assert len(set(a["epoch0"][k]) | set(b["epoch0"][k])) == len(a["epoch0"][k]) + len(b["epoch0"][k])
    assert a["seq"] == [[0, 1], [4, 5], [8]] and b["seq"] == [[2, 3], [6, 7], [9]]


def test_distribute_datasets_from_function_gets_each_workers_input_context(results):
    for rank, r in enumerate(results):
        assert r["input"]["contexts"] == [(2, rank, 2)]
        assert r["input"]["from_fn"] == [[rank]]


def test_missing_torchrun_environment_names_the_variable(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ValueError, match=r"RANK.*torchrun --standalone --nproc_per_node"):
        _strategy()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        _strategy()


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="gradient_compression"):
        _strategy(gradient_compression="int8")


def _uneven_reference():
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT).double()
    b0, b1 = _uneven_batches(0), _uneven_batches(1)
    for k in range(3):
        x = torch.cat([b0[k]] + ([b1[k]] if k < len(b1) else [])).double()
        (model(x).pow(2).sum() / 5).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    return [p.detach().float().numpy() for p in model.parameters()]


def test_uneven_per_worker_input_ends_the_epoch_on_every_worker_by_tfs_rule(results):
    want = _uneven_reference()
    for key in ("known_len", "unknown_len"):
        (rows0, params0), (rows1, params1) = results[0]["uneven"][key], results[1]["uneven"][key]
        assert rows0 == [2, 2, 2] and rows1 == [3, 0, 0], key  # worker 1 ran out: empty batches, same steps
        assert_params_close(params1, params0, what=key)
        assert_params_close(params0, want, what=key)


def test_a_worker_without_any_batch_makes_every_worker_raise_naming_it(results):
    for r in results:
        for name, what in (("known", "have len() 0"), ("unknown", "have no batch at all")):
            msg = r["uneven"][f"dry_{name}"]
            assert f"input pipelines (workers) [1] {what}" in msg, msg
        assert r["uneven"]["after"] == 2.0
