"""Resumed runs equal the uninterrupted ones (issue 36): SIGKILL and SIGTERM on 2 and 3 workers, bit for bit;
elastic resume (3 -> 2 workers, MultiWorkerMirrored <-> Mirrored): same data order, exact state at the
restore, values to float rounding after it.

Each run is tests/scripts/exact_resume_train.py under torchrun (Dropout, Adam, StepLR, a shuffled DataLoader
saved mid-epoch, Python's random and numpy in the loss; BatchNorm where named).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "exact_resume_train.py")
TOTAL_STEPS = 10

# Elastic resume: each replica's share of the global batch changes, so the sums of the gradients round
# differently; after 6 float32 steps of Adam the parameters agree to this.
ELASTIC_RTOL, ELASTIC_ATOL = 1e-5, 1e-6


def _launch(args, nproc=None, max_restarts=0, timeout=150):
    if nproc is None:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.2", SCRIPT, *args]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _load(path):
    return torch.load(path, weights_only=True)


def _assert_same(got, want, what, rtol=0.0, atol=0.0):
    g, gspec = pytree.tree_flatten(got)
    w, wspec = pytree.tree_flatten(want)
    assert gspec == wspec, what
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            if rtol == atol == 0.0 or not b.is_floating_point():
                assert torch.equal(a, b), f"{what}: {a} != {b}"
            else:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=what)
        else:
            assert a == b, f"{what}: {a!r} != {b!r}"


def _faulted_run(tmp_path, nproc, fault, batchnorm=False):
    out = str(tmp_path / "out.pt")
    args = [out, "--fault", fault, "--fault-step", "4"] + (["--batchnorm"] if batchnorm else [])
    proc = _launch(args, nproc=nproc, max_restarts=1)
    assert open(out + ".attempts").read().split() == ["0", "1"], "the job was not restarted once"
    return _load(out), _load(out + ".reference"), proc


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc", [2, 3])
def test_sigkill_mid_epoch_then_restart_resumes_bit_identical(tmp_path, nproc):
    resumed, plain, proc = _faulted_run(tmp_path, nproc, "sigkill")
    assert "exitcode: -9" in proc.stderr  # rank 1 was killed, with no chance to save
    assert resumed["steps"] == TOTAL_STEPS and len(resumed["order"]) == TOTAL_STEPS - 4  # from ckpt-4
    assert resumed["order"] == plain["order"][4:]  # the same global batches, mid-epoch on
    _assert_same(resumed["state"], plain["state"], "model, Adam and StepLR state")
    assert torch.equal(resumed["rng"], plain["rng"])  # every rank's torch random state


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc", [2, 3])
def test_sigterm_preemption_then_restart_resumes_bit_identical(tmp_path, nproc):
    resumed, plain, proc = _faulted_run(tmp_path, nproc, "sigterm")
    assert "exitcode: 42" in proc.stderr  # saved after the step, exited restartable
    assert resumed["order"] == plain["order"][5:]  # SIGTERM in step 5: saved after it
    _assert_same(resumed["state"], plain["state"], "model, Adam and StepLR state")
    assert torch.equal(resumed["rng"], plain["rng"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("nproc", "fault"), [(2, "sigterm"), (3, "sigkill")])
def test_batchnorm_model_resumes_bit_identical_under_the_buffer_rule(tmp_path, nproc, fault):
    # Needs the one buffer rule (issue 35): BatchNorm's running statistics equal on every rank after each
    # optimizer step, so the checkpoint (which saves their cross-rank mean) holds each rank's own value.
    resumed, plain, _ = _faulted_run(tmp_path, nproc, fault, batchnorm=True)
    _assert_same(resumed["state"], plain["state"], "model (BatchNorm buffers included), Adam and StepLR state")
    assert torch.equal(resumed["rng"], plain["rng"])


@pytest.mark.timeout(400)
def test_elastic_resume_3_to_2_workers_and_across_mirrored_continues_the_same_global_batches(tmp_path):
    # A: 3 workers, uninterrupted, saving at step 4 (mid-epoch). B: 2 workers resume A's step 4.
    # C: MirroredStrategy(2) in one process resumes A's step 4 and saves at step 7. D: 3 workers resume C's.
    a, b, c, d = (str(tmp_path / f"{n}.pt") for n in "abcd")
    _launch([a, "--save-at", "4"], nproc=3)
    _launch([b, "--resume", a + ".ckpt"], nproc=2)
    _launch([c, "--mirrored", "2", "--resume", a + ".ckpt", "--save-at", "7"])
    _launch([d, "--resume", c + ".ckpt"], nproc=3)
    ra, rb, rc, rd = (_load(p) for p in (a, b, c, d))
    for name, r, saved_by, at in (("3->2 workers", rb, ra, 4), ("MWMS(3)->Mirrored(2)", rc, ra, 4),
                                  ("Mirrored(2)->MWMS(3)", rd, rc, 7)):
        assert r["restored_step"] == at, name
        _assert_same(r["restored"], saved_by["saved"], f"{name}: the state at the restore")  # exact
        assert r["order"] == ra["order"][at:], f"{name}: data order"  # exact
        _assert_same(r["state"], ra["state"], f"{name}: final state", rtol=ELASTIC_RTOL, atol=ELASTIC_ATOL)
