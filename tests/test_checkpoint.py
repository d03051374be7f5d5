"""torchstrategies.checkpoint: save/restore, atomic chief-only writes, ON_READ aggregation, SIGTERM + restart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.harness import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_save_and_restore_round_trip_without_a_strategy(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, CheckpointManager

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    ckpt = Checkpoint(model=model, optimizer=opt, step=7)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    for s in (7, 8, 9):
        ckpt.step = s
        manager.save()
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-8.pt", "ckpt-9.pt"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-8.pt", "ckpt-9.pt"]  # no temp files left
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    restored = Checkpoint(model=fresh, optimizer=fresh_opt, step=0)
    assert CheckpointManager(restored, str(tmp_path)).restore_or_initialize().endswith("ckpt-9.pt")
    assert restored.step == 9
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_bad_objects_and_missing_files_raise_clear_errors(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, CheckpointManager

    with pytest.raises(TypeError, match="model=str"):
        Checkpoint(model="not a module")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpoint(step=0).restore(str(tmp_path / "nope.pt"))
    assert CheckpointManager(Checkpoint(step=0), str(tmp_path)).restore_or_initialize() is None
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(step=0), str(tmp_path), max_to_keep=0)


def _distributed_body(rank, world, directory):
    import torchstrategies.distribute as tsd
    from torchstrategies.checkpoint import Checkpoint
    from torchstrategies.checkpoint import read_state as read_file
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    s = MultiWorkerMirroredStrategy()
    with s.scope():
        model = _model()
        var = tsd.Variable(torch.tensor(float(rank + 1)), synchronization="on_read", aggregation="sum")
    model(torch.full((6, 3), float(rank)) + torch.arange(6.0)[:, None])  # BatchNorm stats differ per worker
    local_mean = model[1].running_mean.clone()
    ckpt = Checkpoint(model=model, counter=var, step=5)
    path = ckpt.save(os.path.join(directory, "c.pt"))
    listing = sorted(os.listdir(directory))
    fresh = _model()
    with s.scope():
        var2 = tsd.Variable(torch.tensor(0.0), synchronization="on_read", aggregation="sum")
    Checkpoint(model=fresh, counter=var2, step=0).restore(path)
    out = {"local_mean": local_mean.numpy(), "restored_mean": fresh[1].running_mean.clone().numpy(),
           "listing": listing, "var": float(var2.read_value()),
           "saved_var": float(read_file(path)["objects"]["counter"]["state"])}
    s.shutdown()
    return out


@pytest.mark.timeout(90)
def test_chief_writes_aggregated_on_read_state_and_every_worker_restores(tmp_path):
    r0, r1 = run_ranks(_distributed_body, 2, args=(str(tmp_path),), timeout=80)
    want = (torch.from_numpy(r0["local_mean"]) + torch.from_numpy(r1["local_mean"])) / 2
    assert not torch.allclose(torch.from_numpy(r0["local_mean"]), torch.from_numpy(r1["local_mean"]))
    for r in (r0, r1):
        torch.testing.assert_close(torch.from_numpy(r["restored_mean"]), want)  # buffers: the MEAN
        assert r["listing"] == ["c.pt"]  # after the barrier, the one file, no temporaries
        assert r["saved_var"] == 3.0  # ON_READ SUM saved as the sum 1 + 2
        assert r["var"] == 1.5  # ... and restored as value / num_replicas on each worker (TF's rule)


def _torchrun(ckpt_dir, out, sigterm_step=None, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "--monitor-interval=0.2", os.path.join(HERE, "scripts", "mw_resume_train.py"),
           str(ckpt_dir), str(out)]
    if sigterm_step is not None:
        cmd.append(str(sigterm_step))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True), torch.load(str(out) + ".reference", weights_only=True), proc


@pytest.mark.timeout(200)
def test_sigterm_saves_exits_restartable_and_resumes_to_the_uninterrupted_result(tmp_path):
    # One torchrun job: attempt 0 trains an uninterrupted reference, then the checkpointed run, which
    # gets SIGTERM at step 6 of 14, saves, exits 42; torchrun restarts it and it resumes.
    resumed, plain, proc = _torchrun(tmp_path / "ckpts", tmp_path / "b.pt", sigterm_step=6)
    assert open(tmp_path / "b.pt.attempts").read().split() == ["0", "1"]  # it was restarted once
    assert "exitcode: 42" in proc.stderr  # the restartable status
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["checkpoint", "ckpt-7.pt"]  # saved after step 7
    assert plain["steps"] == resumed["steps"] == 14
    for k, v in plain["model"].items():
        if "running" in k:
            # BatchNorm statistics are ON_READ/MEAN: the restart restores every worker to their mean; their
            # cross-worker mean (an EMA, linear) is the same up to float rounding.
            torch.testing.assert_close(resumed["model"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        else:
            torch.testing.assert_close(resumed["model"][k], v, rtol=0, atol=0, msg=k)  # bit for bit
