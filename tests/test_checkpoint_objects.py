"""torchstrategies.checkpoint takes every stateful object of training (issue 36): LR schedulers, GradScaler,
generators and the random state per rank, the buffer rule at save, and torch.distributed.checkpoint."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tests.harness import run_ranks


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_schedulers_grad_scaler_generators_and_random_state_round_trip(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, RandomState

    model, opt, sched = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    scaler._scale = torch.tensor(128.0)  # as after a few overflows
    gen = torch.Generator().manual_seed(5)
    torch.rand(4, generator=gen)
    ckpt = Checkpoint(model=model, optimizer=opt, sched=sched, scaler=scaler, gen=gen, rng=RandomState(), step=3)
    path = ckpt.save(str(tmp_path / "c.pt"))
    after_save = _draws(), torch.rand(2, generator=gen).tolist()

    fresh_model, fresh_opt, fresh_sched = _trained(seed=1)
    fresh_scaler = torch.amp.GradScaler("cpu")
    fresh_gen = torch.Generator().manual_seed(99)
    _draws()
    Checkpoint(model=fresh_model, optimizer=fresh_opt, sched=fresh_sched, scaler=fresh_scaler, gen=fresh_gen,
               rng=RandomState(), step=0).restore(path)
    assert (_draws(), torch.rand(2, generator=fresh_gen).tolist()) == after_save  # torch, Python, numpy, generator
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.05
    assert fresh_scaler.state_dict() == scaler.state_dict()
    assert fresh_scaler.get_scale() == 128.0
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
        assert torch.equal(a, b)


def test_what_a_checkpoint_cannot_save_is_a_type_error_naming_it_and_what_it_takes():
    from torchstrategies.checkpoint import Checkpoint

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    with pytest.raises(TypeError, match=r"loader=DataLoader .*experimental_distribute_dataset.*LR scheduler"):
        Checkpoint(loader=loader)
    with pytest.raises(TypeError, match=r"thing=object cannot be saved; it accepts torch.nn.Module"):
        Checkpoint(thing=object())
    with pytest.raises(TypeError, match=r"flag=True is a bool"):
        Checkpoint(flag=True)

    class OnlySaves:
        def state_dict(self):
            return {}

    with pytest.raises(TypeError, match="only=OnlySaves"):
        Checkpoint(only=OnlySaves())  # state_dict without load_state_dict cannot be restored


def _buffer_rule_body(rank, world, directory):
    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint
    from torchstrategies.checkpoint import read_state as read_file
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy()
    with s.scope():
        model = torch.nn.Module()
        model.register_buffer("same", torch.randn(1000, generator=torch.Generator().manual_seed(3)))
        model.register_buffer("differ", torch.full((4,), float(rank)))
        model.register_buffer("count", torch.tensor(7))
        model.register_buffer("queue", torch.zeros(4))
    ts.declare_buffer_aggregation(model, "differ", "mean")   # a running statistic: its copies are averaged
    model.differ.fill_(float(rank))  # (the scope broadcast rank 0's)
    (mean_of_same,) = s.extended.all_reduce_tensors("mean", [model.same])
    torch.manual_seed(10 + rank)
    path = Checkpoint(model=model).save(os.path.join(directory, "c.pt"))  # every rank's random state, by default
    mine = torch.rand(3)
    saved = read_file(path)["objects"]["model"]["state"]
    torch.manual_seed(1234)
    seeded_draw = torch.rand(3)
    torch.manual_seed(1234)
    Checkpoint(model=model, save_random_state=False).restore(path)
    untouched = torch.equal(torch.rand(3), seeded_draw)
    torch.manual_seed(1234)
    Checkpoint(model=model).restore(path)
    restored_draw = torch.rand(3)
    errors = []
    for name in ("queue", "count"):   # a floating buffer not declared MEAN, an integer one: must agree
        getattr(model, name).fill_(rank)
        try:
            Checkpoint(model=model).save(os.path.join(directory, "bad.pt"))
            errors.append(None)
        except ts.errors.ReplicaDivergenceError as exc:
            errors.append(str(exc))
        getattr(model, name).fill_(0)
    s.shutdown()
    return {"same_ok": torch.equal(saved["same"], model.same),
            "mean_rounds": not torch.equal(mean_of_same, model.same),
            "differ": saved["differ"].tolist(), "own_rng": torch.equal(mine, restored_draw), "untouched": untouched,
            "errors": errors}


@pytest.mark.timeout(120)
def test_saved_buffers_follow_the_buffer_rule_and_each_rank_gets_its_own_random_state(tmp_path):
    results = run_ranks(_buffer_rule_body, 3, args=(str(tmp_path),), timeout=110)
    for r in results:
        assert r["mean_rounds"]  # the test's point: a mean of 3 equal float32 values is not always the value
        assert r["same_ok"]  # buffers equal on every rank are saved bit for bit
        assert r["differ"] == [1.0] * 4  # a differing buffer declared MEAN: its cross-rank mean (0 + 1 + 2) / 3
        assert r["own_rng"]  # rank r's random state went back to rank r
        assert r["untouched"]  # save_random_state=False leaves it alone
        queue, count = r["errors"]
        assert queue is not None and "buffer model.queue differs between the ranks" in queue, queue
        assert count is not None and "integer buffer model.count differs between the ranks" in count, count
        assert "ranks [1, 2] hold values that differ from rank 0's" in queue, queue


def _dcp_body(rank, world, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from torchstrategies.checkpoint import Checkpoint, RandomState
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    out = {}
    # A DDP job saves its model and optimizer with DCP, as torch documents.
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    for i in range(2):
        ddp(torch.randn(4, 3) + rank + i).sum().backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    ddp_dir = os.path.join(directory, "ddp")
    dcp.save({"model": get_model_state_dict(ddp), "optimizer": get_optimizer_state_dict(ddp, ddp_opt)},
             checkpoint_id=ddp_dir)

    s = MultiWorkerMirroredStrategy()
    pg = s.extended.process_group

    def build(seed):
        torch.manual_seed(seed or 0)
        with s.scope():
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
        if seed is None:  # as the DDP job: no scheduler (StepLR adds "initial_lr" to the param groups)
            return model, opt, None, None
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(16.0)), batch_size=4,
                                             shuffle=True, generator=torch.Generator().manual_seed(seed))
        data = s.experimental_distribute_dataset(loader)
        return model, opt, sched, data

    # The DDP checkpoint loads into an MWMS model and optimizer.
    model, opt, _, _ = build(seed=None)
    ckpt = Checkpoint(model=model, optimizer=opt)
    state = ckpt.state_dict()
    dcp.load(state, checkpoint_id=ddp_dir, process_group=pg)
    ckpt.load_state_dict(state)
    out["ddp_params"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp.module.parameters()))
    out["ddp_adam"] = all(torch.equal(opt.state[a]["exp_avg_sq"], ddp_opt.state[b]["exp_avg_sq"])
                          for a, b in zip(model.parameters(), ddp.module.parameters()))

    # An MWMS job's whole state, saved with DCP and loaded back into fresh objects.
    model, opt, sched, data = build(seed=5)
    it = iter(data)
    for _ in range(2):
        (x,) = next(it)
        s.run(lambda x: model(x[:, None].expand(-1, 3)).sum().backward(), args=(x,))
        opt.step()
        opt.zero_grad()
        sched.step()
    torch.manual_seed(50 + rank)
    job = Checkpoint(model=model, optimizer=opt, sched=sched, data=data, rng=RandomState(), step=2)
    job_dir = os.path.join(directory, "job")
    dcp.save(job.state_dict(), checkpoint_id=job_dir, process_group=pg)
    want_draw, want_batch = torch.rand(2), next(it)[0]

    model2, opt2, sched2, data2 = build(seed=6)
    torch.manual_seed(999)
    job2 = Checkpoint(model=model2, optimizer=opt2, sched=sched2, data=data2, rng=RandomState(), step=0)
    state = job2.state_dict()
    dcp.load(state, checkpoint_id=job_dir, process_group=pg)
    job2.load_state_dict(state)
    out["job_params"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    out["job_adam"] = all(torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"])
                          for a, b in zip(model.parameters(), model2.parameters()))
    out["sched"] = sched2.state_dict() == sched.state_dict()
    out["step"] = job2.step
    out["rng"] = torch.equal(torch.rand(2), want_draw)
    out["data"] = torch.equal(next(iter(data2))[0], want_batch)
    s.shutdown()
    return out


@pytest.mark.timeout(120)
def test_torch_distributed_checkpoint_saves_and_loads_an_mwms_job_and_loads_a_ddp_checkpoint(tmp_path):
    for r in run_ranks(_dcp_body, 2, args=(str(tmp_path),), timeout=110):
        assert r == {"ddp_params": True, "ddp_adam": True, "job_params": True, "job_adam": True, "sched": True,
                     "step": 2, "rng": True, "data": True}


def _in_process_job(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(24, 3, generator=g), torch.arange(24)), batch_size=6,
        shuffle=True, generator=torch.Generator().manual_seed(4))
    data = strategy.experimental_distribute_dataset(loader)

    def replica_step(x, ids):
        opt.zero_grad()
        (model(x).pow(2).sum() / 6).backward()
        opt.step()

    def steps(n, it):
        order = []
        for _ in range(n):
            x, ids = next(it)
            strategy.run(replica_step, args=(x, ids))
            sched.step()
            order.append(strategy.gather(ids, axis=0).tolist())
        return order

    return model, opt, sched, data, steps


def _epochs(data):
    while True:  # each new iteration starts the next epoch (a restored dataset: the interrupted one first)
        yield from data


def test_in_process_strategies_resume_each_others_checkpoints_and_plain_torch_reads_them(tmp_path):
    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint

    model, opt, sched, data, steps = _in_process_job(ts.MirroredStrategy(num_replicas=2))
    it = _epochs(data)
    steps(2, it)  # mid-epoch (4 global batches an epoch)
    path = Checkpoint(model=model, optimizer=opt, sched=sched, data=data).save(str(tmp_path / "m.pt"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    want_order = steps(4, it)  # crosses into the next epoch

    central = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"], parameter_device="cpu")
    model2, opt2, sched2, data2, steps2 = _in_process_job(central)
    Checkpoint(model=model2, optimizer=opt2, sched=sched2, data=data2).restore(path)
    assert steps2(4, _epochs(data2)) == want_order  # the same global batches
    for a, b in zip(model2.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    plain = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=2, gamma=0.5)
    Checkpoint(model=plain, optimizer=plain_opt, sched=plain_sched).restore(path)  # no strategy: no data position
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in saved.items())
    assert plain_sched.last_epoch == 2 and plain_opt.state_dict()["state"][0]["step"] == 2
