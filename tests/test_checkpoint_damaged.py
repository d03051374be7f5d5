"""Damaged checkpoints (issue 47): a clear error naming the file, nothing half-loaded, the older good
checkpoint used (every worker the same one), and no temporaries of killed saves left behind."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import pytest
import torch

from tests.harness import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _model(out: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, out))


def _trained(out: int = 4, seed: int = 0):
    model = _model(out, seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _snapshot(model, opt, sched, ckpt) -> dict:
    """Everything a restore could touch, copied (the random state as the next draws it gives)."""
    state = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": repr(opt.state_dict()), "sched": repr(sched.state_dict()), "step": ckpt.step}
    rng = (torch.get_rng_state(), random.getstate())
    state["draws"] = (torch.rand(3).tolist(), random.random())
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    return state


def _same(a: dict, b: dict) -> bool:
    same_model = a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k])
                                                               for k in a["model"])
    return same_model and all(a[k] == b[k] for k in ("opt", "sched", "step", "draws"))


def _damage(path: str, how: str) -> str:
    """Damages the checkpoint at ``path``; returns what the error must say."""
    data = open(path, "rb").read()
    if how == "truncated":
        open(path, "wb").write(data[:len(data) // 2])
        return f"truncated at byte {len(data) // 2} of {len(data)}"
    if how == "truncated header":
        open(path, "wb").write(data[:20])
        return "truncated at byte 20"
    if how == "empty":
        open(path, "wb").close()
        return "is empty"
    if how == "flipped bytes":
        b = bytearray(data)
        for i in range(len(b) // 3, len(b) // 3 + 16):
            b[i] ^= 0x5A
        open(path, "wb").write(bytes(b))
        return "checksum mismatch"
    if how == "random bytes":
        open(path, "wb").write(random.Random(1).randbytes(len(data)))
        return "not a torchstrategies checkpoint"
    if how == "appended bytes":
        open(path, "ab").write(b"\0" * 10)
        return "10 bytes after its end"
    raise AssertionError(how)


DAMAGES = ["truncated", "truncated header", "empty", "flipped bytes", "random bytes", "appended bytes"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_file_raises_checkpoint_error_naming_it_and_changes_nothing(tmp_path, how):
    from torchstrategies.checkpoint import Checkpoint, CheckpointError

    path = Checkpoint(**dict(zip(("model", "opt", "sched"), _trained())), step=7).save(str(tmp_path / "c.pt"))
    want = _damage(path, how)
    model, opt, sched = _trained(seed=1)
    ckpt = Checkpoint(model=model, opt=opt, sched=sched, step=3)
    before = _snapshot(model, opt, sched, ckpt)
    with pytest.raises(CheckpointError) as err:
        ckpt.restore(path)
    msg = str(err.value)
    assert repr(path) in msg and want in msg, msg
    assert "weights_only" not in msg, msg  # never the advice to unpickle an untrusted file
    assert isinstance(err.value, ValueError)
    assert _same(before, _snapshot(model, opt, sched, ckpt))


@pytest.mark.parametrize("case", ["other shape", "other model", "other optimizer"])
def test_a_checkpoint_of_another_model_raises_before_loading_anything(tmp_path, case):
    from torchstrategies.checkpoint import Checkpoint, CheckpointError

    model, opt, sched = _trained(out=4)
    path = Checkpoint(model=model, opt=opt, sched=sched, step=7).save(str(tmp_path / "c.pt"))
    if case == "other shape":  # the last layer is wider: 2.weight is the first tensor that differs
        model, opt, sched = _trained(out=8, seed=1)
        want = "model: parameter 2.weight: saved (4, 8), model (8, 8)"
    elif case == "other model":
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        want = "model: the model lacks ['1.running_mean', '1.running_var'"
    else:  # the model fits, the optimizer holds other parameters (a fresh one: no live state)
        model = _model(out=4, seed=1)
        other = torch.nn.Linear(8, 8)
        opt = torch.optim.Adam(list(other.parameters()) + list(model.parameters())[2:], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        want = "opt: state 'exp_avg' of parameter 0: saved (8, 3), parameter (8, 8)"
    ckpt = Checkpoint(model=model, opt=opt, sched=sched, step=3)
    before = _snapshot(model, opt, sched, ckpt)
    with pytest.raises(CheckpointError, match="c.pt") as err:
        ckpt.restore(path)
    assert want in str(err.value), str(err.value)
    assert _same(before, _snapshot(model, opt, sched, ckpt))  # on main, 0.* and 1.* were loaded before the error


def test_restore_or_initialize_skips_damaged_checkpoints_with_a_warning_and_takes_the_newest_good_one(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, CheckpointManager

    model, opt, sched = _trained()
    ckpt = Checkpoint(model=model, opt=opt, sched=sched, step=0)
    manager = CheckpointManager(ckpt, str(tmp_path), max_to_keep=5)
    saved = {}
    for step in (1, 2, 3):
        ckpt.step = step
        with torch.no_grad():
            model[0].bias.fill_(float(step))
        saved[step] = manager.save()
    _damage(saved[3], "truncated")
    _damage(saved[2], "flipped bytes")
    fresh, fopt, fsched = _trained(seed=1)
    restored = Checkpoint(model=fresh, opt=fopt, sched=fsched, step=0)
    with pytest.warns(RuntimeWarning) as record:
        assert CheckpointManager(restored, str(tmp_path)).restore_or_initialize() == saved[1]
    texts = [str(w.message) for w in record]
    assert any("ckpt-3.pt" in t and "truncated" in t for t in texts), texts
    assert any("ckpt-2.pt" in t and "checksum mismatch" in t for t in texts), texts
    assert restored.step == 1 and torch.equal(fresh[0].bias, torch.full((8,), 1.0))

    _damage(saved[1], "empty")  # none is good: nothing restored, nothing changed
    other, oopt, osched = _trained(seed=2)
    nothing = Checkpoint(model=other, opt=oopt, sched=osched, step=0)
    before = _snapshot(other, oopt, osched, nothing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert CheckpointManager(nothing, str(tmp_path)).restore_or_initialize() is None
    assert _same(before, _snapshot(other, oopt, osched, nothing))


def test_the_preemption_handler_resumes_from_the_newest_good_checkpoint(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, CheckpointManager, PreemptionCheckpointHandler

    model = _model()
    ckpt = Checkpoint(model=model, step=0)
    manager = CheckpointManager(ckpt, str(tmp_path))
    for step in (4, 5):
        ckpt.step = step
        manager.save()
    _damage(os.path.join(str(tmp_path), "ckpt-5.pt"), "random bytes")
    resumed = Checkpoint(model=_model(seed=1), step=0)
    with pytest.warns(RuntimeWarning, match="ckpt-5.pt"):
        handler = PreemptionCheckpointHandler(CheckpointManager(resumed, str(tmp_path)), exit_fn=lambda code: None)
    try:
        assert handler.restored_from.endswith("ckpt-4.pt") and handler.total_run_calls == 4
    finally:
        handler.close()


_KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from torchstrategies.checkpoint import Checkpoint, CheckpointManager
manager = CheckpointManager(Checkpoint(model=torch.nn.Linear(64, 64), step=1), {directory!r})
manager.save()
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # dies between the write and the rename
manager.checkpoint.step = 2
manager.save()
"""


def test_a_save_killed_mid_write_leaves_a_temporary_that_restore_ignores_and_the_next_save_removes(tmp_path):
    from torchstrategies.checkpoint import Checkpoint, CheckpointManager

    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE.format(root=ROOT, directory=str(tmp_path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = sorted(os.listdir(tmp_path))
    assert left[0].startswith(".ckpt-2.pt.tmp-") and left[1:] == ["checkpoint", "ckpt-1.pt"], left
    ckpt = Checkpoint(model=torch.nn.Linear(64, 64), step=0)
    manager = CheckpointManager(ckpt, str(tmp_path))
    assert manager.restore_or_initialize().endswith("ckpt-1.pt") and ckpt.step == 1  # the temporary is no candidate
    ckpt.step = 3
    manager.save()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1.pt", "ckpt-3.pt"]


def test_a_checkpoint_of_the_first_format_still_restores(tmp_path):
    from torchstrategies.checkpoint import Checkpoint

    model = _model(seed=3)
    state = {"format": "torchstrategies-checkpoint-1", "ints": {"step": 4},
             "objects": {"model": {"kind": "module", "state": model.state_dict()}}}
    torch.save(state, str(tmp_path / "old.pt"))  # what checkpoints were before the checksum
    fresh = _model(seed=4)
    ckpt = Checkpoint(model=fresh, step=0, save_random_state=False).restore(str(tmp_path / "old.pt"))
    assert ckpt.step == 4 and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                                      fresh.state_dict().values()))


def _mwms_body(rank, world, directory, damage_rank):
    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint, CheckpointError, CheckpointManager

    s = ts.MultiWorkerMirroredStrategy()
    with s.scope():
        model = _model(seed=0)
    ckpt = Checkpoint(model=model, step=0)
    shared = os.path.join(directory, "shared")
    manager = CheckpointManager(ckpt, shared)
    for step in (1, 2):
        ckpt.step = step
        with torch.no_grad():
            model[0].bias.fill_(float(step))
        manager.save()
    out: dict = {}
    # every damage in every rank: a CheckpointError naming the file, nothing changed
    for how in DAMAGES:
        path = os.path.join(directory, f"{how}.pt")
        Checkpoint(model=model, step=5).save(path)
        if rank == 0:
            _damage(path, how)
        s.extended.barrier()
        fresh = _model(seed=1)
        before = [t.clone() for t in fresh.state_dict().values()]
        try:
            Checkpoint(model=fresh, step=0).restore(path)
            out[how] = "restored"
        except CheckpointError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, fresh.state_dict().values()))
            out[how] = f"{'unchanged' if unchanged else 'CHANGED'}: {exc}"
    wide = _model(out=8, seed=1)
    try:
        Checkpoint(model=wide, step=0).restore(manager.latest_checkpoint)
        out["other shape"] = "restored"
    except CheckpointError as exc:
        out["other shape"] = str(exc)
    # fallback: the newest is damaged (on every rank: a shared folder) -> both take ckpt-1
    if rank == 0:
        _damage(os.path.join(shared, "ckpt-2.pt"), "flipped bytes")
    s.extended.barrier()
    fresh = _model(seed=1)
    restored = Checkpoint(model=fresh, step=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out["fallback"] = os.path.basename(CheckpointManager(restored, shared).restore_or_initialize())
    out["fallback_step"] = restored.step
    out["fallback_warned"] = any("ckpt-2.pt" in str(x.message) for x in w)
    # each rank its own copy of the folder, the newest damaged on one rank only: every rank takes ckpt-1
    for step in (1, 2):
        Checkpoint(model=model, step=step).save(os.path.join(directory, "own0", f"ckpt-{step}.pt"))
    if rank == 0:
        import shutil
        shutil.copytree(os.path.join(directory, "own0"), os.path.join(directory, "own1"))
    s.extended.barrier()
    own = os.path.join(directory, f"own{rank}")
    if rank == damage_rank:
        _damage(os.path.join(own, "ckpt-2.pt"), "truncated")
    agreed = Checkpoint(model=_model(seed=1), step=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["agreed"] = os.path.basename(CheckpointManager(agreed, own).restore_or_initialize())
    out["agreed_step"] = agreed.step
    s.shutdown()
    return out


@pytest.mark.timeout(150)
def test_under_mwms_every_rank_raises_on_a_damaged_file_and_all_ranks_fall_back_to_the_same_checkpoint(tmp_path):
    res = run_ranks(_mwms_body, 2, args=(str(tmp_path), 1), timeout=140)
    for rank, out in enumerate(res):
        for how in DAMAGES:
            assert out[how].startswith("unchanged: checkpoint ") and f"{how}.pt" in out[how], (rank, how, out[how])
        assert "model: parameter 2.weight: saved (4, 8), model (8, 8)" in out["other shape"], (rank, out)
        assert (out["fallback"], out["fallback_step"], out["fallback_warned"]) == ("ckpt-1.pt", 1, True), (rank, out)
        assert (out["agreed"], out["agreed_step"]) == ("ckpt-1.pt", 1), (rank, out)  # rank 0's ckpt-2 was good
