"""Fault-tolerant MultiWorkerMirrored under real processes: a worker killed (SIGKILL) or frozen (SIGSTOP) costs
no step. Each run: 3 workers under the fault-tolerant launcher (which restarts a dead worker alone, as
``torchrun --max-restarts`` would restart the whole job), float64 MLP, SGD with momentum, StepLR, a shuffled
dataset, the ordinary step code in ``step_fn`` (backward, optional clip_grad_norm_, optimizer and scheduler
steps, zero_grad; tests/_ft_worker.py). Every run checks: the survivors' pids never changed; every step was applied
exactly once by each process that held the state at that step (counted by an optimizer post-hook); the
final parameters equal one device's run over the same global batches within 1e-12; every worker holds the
same parameters, momentum, scheduler step and random states (torch, Python, numpy) bit for bit, each being
one draw per committed step (a discarded step's draws are given back); no thread is left after
``shutdown()`` and no shared-memory segment is left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np
import pytest
import torch

from tests import _ft_worker
from torchstrategies.strategies.fault_tolerance import GlobalBatches
from torchstrategies.strategies.fault_tolerance.launch import Worker, launch

STEPS = 12
TIMEOUT = 3.0  # the collective and commit timeout of these runs (a frozen worker is dropped after it)
TOLERANCE = 1e-12  # |parameter - one device's| (float64; the gradient sum is grouped differently)


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "torchstrat" in n or "tstrat" in n}


def _reference(steps: int, clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One device, the whole global batch each step, the workers' step code: the parameters and momentum
    after ``steps``, and the last step's loss."""
    dataset, model = _ft_worker.problem()
    opt, sched = _ft_worker.optimizer_and_scheduler(model)
    data = GlobalBatches(dataset, _ft_worker.GLOBAL_BATCH, seed=7)
    for k in range(steps):
        loss = _ft_worker.train_step(model, opt, sched, data.local_batch(k, 0, 1), clip)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return flat, momentum, float(loss)


def _resume_stopped(stopped: dict[int, float]):
    """An on_tick for the launcher: SIGCONT a worker TIMEOUT + 2 s after it stopped itself."""

    def tick(workers: list[Worker]) -> None:
        for w in workers:
            if w.process.poll() is not None:
                continue
            try:
                with open(f"/proc/{w.process.pid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state == "T":
                first = stopped.setdefault(w.process.pid, time.monotonic())
                if time.monotonic() - first > TIMEOUT + 2:
                    os.kill(w.process.pid, signal.SIGCONT)

    return tick


def _run(tmp_path, faults: list[dict], *, nproc: int = 3, max_restarts: int = 2, min_workers: int = 1,
         wait_full: int | None = None, clip: float = 0.0, batchnorm: bool = False, diverge: int = -1,
         reduce: bool = False, implementation: str = "GLOO") -> tuple[list[Worker], list[dict]]:
    shm_before = _shm()
    env = dict(os.environ, FT_OUT=str(tmp_path), FT_STEPS=str(STEPS), FT_TIMEOUT=str(TIMEOUT),
               FT_FAULTS=json.dumps(faults), FT_MIN_WORKERS=str(min_workers),
               FT_WAIT_FULL=str(nproc if wait_full is None else wait_full), FT_CLIP=str(clip),
               FT_BATCHNORM=str(int(batchnorm)), FT_DIVERGE=str(diverge),
               FT_REDUCE=str(int(reduce)), FT_IMPLEMENTATION=implementation,
               TORCHSTRATEGIES_LOG_LEVEL="ERROR")
    stopped: dict[int, float] = {}
    workers = launch([sys.executable, _ft_worker.__file__], nproc, max_restarts, env=env, timeout=100,
                     on_tick=_resume_stopped(stopped))
    results = [json.loads((tmp_path / f).read_text()) for f in sorted(os.listdir(tmp_path)) if f.endswith(".json")]
    assert _shm() <= shm_before, f"shared-memory segments left: {_shm() - shm_before}"
    return workers, results


def _check_recovered(workers: list[Worker], results: list[dict], faulted: set[int], clip: float = 0.0) -> None:
    assert all(w.returncode == 0 for w in workers), [(w.slot, w.pids, w.returncode) for w in workers]
    for w in workers:
        if w.slot not in faulted:
            assert len(w.pids) == 1, f"survivor slot {w.slot} was restarted: pids {w.pids}"
    final = [r for r in results if r["pid"] in {w.pids[-1] for w in workers}]
    assert len(final) == len(workers)
    steps = final[0]["steps"]
    assert steps >= STEPS
    for r in final:
        assert r["steps"] == steps and r["error"] is None
        # Every step from the one it healed at (0: it started with the job) applied exactly once; before a
        # heal (a frozen worker that was refused) the steps it applied were consecutive from 0.
        h = r["healed_at"] or 0
        assert [a for a in r["applied"] if a >= h] == list(range(h, steps)), (r["slot"], h, r["applied"])
        before = [a for a in r["applied"] if a < h]
        assert before == list(range(len(before))), (r["slot"], before)
        assert r["threads"] == ["MainThread"], r["threads"]
        assert r["tasks_at_end"] <= r["tasks_after_first"], (r["tasks_at_end"], r["tasks_after_first"])
        for key in ("params", "momentum", "rng", "py_rng", "np_rng", "sched", "lr"):
            assert r[key] == final[0][key], f"slot {r['slot']} differs from slot {final[0]['slot']} in {key}"
    # The random states (torch's, Python's, numpy's) are the first generation's source's (seeded 100 + its
    # slot) after one draw of each per committed step: a discarded step's draws were given back, and a
    # returning worker received them.
    expected = []
    for s in range(3):
        _ft_worker.seed_all(100 + s)
        for _ in range(steps):
            torch.rand(()), random.random(), np.random.rand()
        expected.append(_ft_worker.random_hashes())
    got = {k: final[0][k] for k in ("rng", "py_rng", "np_rng")}
    assert got in expected, (got, expected)
    params, momentum, loss = _reference(steps, clip)
    torch.testing.assert_close(torch.tensor(final[0]["params"], dtype=torch.float64), params, rtol=0,
                               atol=TOLERANCE)
    torch.testing.assert_close(torch.tensor(final[0]["momentum"], dtype=torch.float64), momentum, rtol=0,
                               atol=TOLERANCE)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [5, 11])  # (slot 2, "commit", step 7), (slot 1, "apply", step 5)
def test_a_worker_killed_at_a_random_step_and_phase_costs_no_step_and_rejoins(tmp_path, seed):
    import random

    rng = random.Random(seed)
    slot = rng.randrange(3)
    phase = rng.choice(["forward", "all_reduce", "commit", "apply"])
    fault = {"slot": slot, "restart": 0, "at_least_step": rng.randrange(2, STEPS - 4), "phase": phase,
             "action": "kill"}
    workers, results = _run(tmp_path, [fault])
    victim = next(w for w in workers if w.slot == slot)
    assert len(victim.pids) == 2
    _check_recovered(workers, results, {slot})
    rejoined = next(r for r in results if r["pid"] == victim.pids[-1])
    assert rejoined["healed_at"] >= fault["at_least_step"]
    survivors = [r for r in results if r["slot"] != slot]
    # Killed before its collectives completed, the step is discarded by the survivors and redone; killed
    # at "commit" or "apply" (its collectives completed on it, so on the survivors too, or on some of them:
    # those heal the others), the survivors discard the next step: either way each survivor discards one
    # step at most and applied none twice (checked above).
    assert all(r["aborted"] <= 1 for r in survivors)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("implementation", ["GLOO", "AUTO"])
def test_a_worker_killed_at_the_commit_point_costs_no_step_on_gloo_and_on_our_backend(tmp_path, implementation):
    # Slot 1 dies at the end of its backward, as its gradients' all-reduce is about to start; the survivors'
    # all-reduce (or their agreement check's) fails on each of them: nothing of the step is applied, the
    # survivors redo it, and slot 1 rejoins. On our backend (AUTO: shared memory, collectives run on the
    # caller's thread) no segment is left either (_run checks /dev/shm).
    fault = {"slot": 1, "restart": 0, "at_least_step": 4, "phase": "all_reduce", "action": "kill"}
    workers, results = _run(tmp_path, [fault], implementation=implementation)
    assert len(next(w for w in workers if w.slot == 1).pids) == 2
    _check_recovered(workers, results, {1})
    survivors = [r for r in results if r["slot"] != 1]
    assert len(survivors) == 2 and all(r["aborted"] >= 1 for r in survivors)


@pytest.mark.timeout(150)
def test_clip_grad_norm_and_a_scheduler_in_step_fn_see_the_global_gradient_under_a_kill(tmp_path):
    # max_norm 1.0 clips most steps of the global gradient (norms 0.5 to 2.0): clipping a member's partial
    # gradient, or one step applied twice or lost, would leave the parameters far from one device's. step_fn
    # also reduces its loss before backward (part of the step): slot 0 dies as the step starts, so the
    # survivors' reduce fails, which discards the step, and step_fn is redone by the survivors.
    fault = {"slot": 0, "restart": 0, "at_least_step": 4, "phase": "forward", "action": "kill"}
    workers, results = _run(tmp_path, [fault], clip=1.0, reduce=True)
    _check_recovered(workers, results, {0}, clip=1.0)
    assert any(r["aborted"] >= 1 for r in results if r["slot"] != 0)
    final = [r for r in results if r["pid"] in {w.pids[-1] for w in workers}]
    _, _, loss = _reference(final[0]["steps"], clip=1.0)
    for r in final:  # what step_fn returned: the global batch's loss, reduced before backward
        assert r["loss"] == pytest.approx(loss, rel=0, abs=TOLERANCE)


@pytest.mark.timeout(150)
def test_two_workers_killed_in_a_row_cost_no_step(tmp_path):
    faults = [{"slot": 1, "restart": 0, "at_least_step": 3, "phase": "all_reduce", "action": "kill"},
              {"slot": 2, "restart": 0, "at_least_step": 4, "phase": "forward", "action": "kill"}]
    workers, results = _run(tmp_path, faults)
    _check_recovered(workers, results, {1, 2})
    survivor = next(r for r in results if r["slot"] == 0)
    assert survivor["aborted"] >= 2


@pytest.mark.timeout(150)
def test_a_frozen_worker_is_dropped_after_the_timeout_refused_when_it_wakes_and_rejoins_as_new(tmp_path):
    # Frozen at step 4 once its collectives completed, before it applies the step: the others apply it (or
    # discard it, if it froze before they had its last part), their next all-reduce waits for it until the
    # timeout, fails, and they form the next generation without it (its heartbeat is silent). Woken, it
    # applies the step (its collectives completed), its next collective fails at once (the others tore the
    # group down), and the generation it registers for closed without it: refused, it comes back without
    # state and is healed from a live member, so the step it applied alone does not survive.
    faults = [{"slot": 2, "restart": 0, "at_least_step": 4, "phase": "commit", "action": "stop"}]
    workers, results = _run(tmp_path, faults)
    _check_recovered(workers, results, set())
    frozen = next(r for r in results if r["slot"] == 2)
    assert frozen["refused"] >= 1 and frozen["healed_at"] >= 4
    assert frozen["applied"][:4] == [0, 1, 2, 3]


@pytest.mark.timeout(150)
def test_a_step_applied_by_some_members_and_discarded_by_one_ends_applied_once_on_every_member(tmp_path):
    # Step 4's collectives complete on every member, but slot 1 counts them as failed (the phase hook raises
    # CollectiveFailed at "commit", as when a member's last receive fails after the others got everything):
    # slot 1 discards step 4 and tears the group down; slots 0 and 2 applied it, their step 5 fails at once,
    # they discard it, and the three register for the next generation with 5, 4 and 5 steps. It copies a
    # member at 5 steps to slot 1: nobody restarted, step 4 applied once everywhere, nothing lost. On gloo,
    # where slot 1's teardown (its connections close) reaches the others after the data they were reading;
    # on our shared memory the abort flag may reach one still inside the step's last barrier, which then
    # discards step 4 too (as correct, but not the case shown here).
    fault = {"slot": 1, "restart": 0, "at_least_step": 4, "phase": "commit", "action": "fail"}
    workers, results = _run(tmp_path, [fault], max_restarts=0)
    _check_recovered(workers, results, set())
    by_slot = {r["slot"]: r for r in results}
    assert len(by_slot) == 3
    assert by_slot[1]["aborted"] == 1 and by_slot[1]["healed_at"] == 5 and by_slot[1]["refused"] == 0
    assert by_slot[1]["applied"][:5] == [0, 1, 2, 3, 5]  # step 4 came with the state, not applied again
    for s in (0, 2):
        assert by_slot[s]["aborted"] == 1 and not by_slot[s]["healed_at"]  # step 5, redone; healed at 0 at most


@pytest.mark.timeout(150)
def test_the_heal_source_and_the_returning_worker_killed_during_the_heal_cost_no_step(tmp_path):
    # Slot 1 dies; when it comes back, whichever survivor sends it the state dies as it starts sending
    # (once), and the returning worker itself dies the first time it has received the state's header: it
    # still has no state, comes back again and heals from the last survivor that has the state.
    faults = [{"slot": 1, "restart": 0, "at_least_step": 3, "phase": "forward", "action": "kill"},
              {"slot": 1, "restart": 1, "at_least_step": -1, "phase": "heal_header", "action": "kill"}] + [
        {"slot": s, "restart": 0, "at_least_step": 1, "phase": "heal_send", "action": "kill", "once": "source"}
        for s in (0, 2)]
    workers, results = _run(tmp_path, faults)
    assert (tmp_path / "source").exists()
    killed = {w.slot for w in workers if len(w.pids) > 1}
    assert 1 in killed and len(killed) == 2
    assert len(next(w for w in workers if w.slot == 1).pids) == 3
    _check_recovered(workers, results, killed)


@pytest.mark.timeout(150)
def test_fewer_live_workers_than_min_workers_stops_the_job_with_a_named_error(tmp_path):
    faults = [{"slot": 1, "restart": 0, "at_least_step": 3, "phase": "forward", "action": "kill"}]
    workers, results = _run(tmp_path, faults, nproc=2, max_restarts=0, min_workers=2, wait_full=0)
    (survivor,) = results
    assert survivor["slot"] == 0 and survivor["steps"] == 3
    assert survivor["error"].startswith("MembershipBelowMinimumError")
    assert "min_workers=2" in survivor["error"]
    assert [w.returncode for w in workers] == [3, -signal.SIGKILL]


@pytest.mark.timeout(150)
def test_batchnorm_running_mean_is_the_global_batch_s_and_the_variance_follows_the_documented_rule(tmp_path):
    # A BatchNorm1d on the input, 3 workers, one killed at step 4 (the step is redone by 2, then 3 again).
    # Each member's forward normalizes with its own rows' statistics (plain BatchNorm: the parameters are
    # not one device's, only equal on every worker); its running statistics are summed weighted by its share
    # of the rows. So running_mean is the global batch's mean, exactly (up to rounding), and running_var is
    # the rows-weighted mean of the members' unbiased variances (docs/fault_tolerance.md, BatchNorm).
    fault = {"slot": 2, "restart": 0, "at_least_step": 4, "phase": "forward", "action": "kill"}
    workers, results = _run(tmp_path, [fault], batchnorm=True)
    assert all(w.returncode == 0 for w in workers)
    final = [r for r in results if r["pid"] in {w.pids[-1] for w in workers}]
    for r in final:
        assert r["buffers"] == final[0]["buffers"] and r["params"] == final[0]["params"]
    survivor = next(r for r in results if r["slot"] == 0)
    steps = survivor["steps"]
    assert survivor["applied"] == list(range(steps)) and 2 in survivor["sizes"] and 3 in survivor["sizes"]
    dataset, _ = _ft_worker.problem()
    data = GlobalBatches(dataset, _ft_worker.GLOBAL_BATCH, seed=7)
    mean, var, one_device_var = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64), \
        torch.ones(6, dtype=torch.float64)
    for k, n in enumerate(survivor["sizes"]):
        x = data.local_batch(k, 0, 1)[0]
        mean = 0.9 * mean + 0.1 * x.mean(0)
        one_device_var = 0.9 * one_device_var + 0.1 * x.var(0)
        parts = [data.local_batch(k, i, n)[0] for i in range(n)]
        var = 0.9 * var + 0.1 * sum(len(p) / len(x) * p.var(0) for p in parts)
    got = final[0]["buffers"]
    torch.testing.assert_close(torch.tensor(got["0.running_mean"], dtype=torch.float64), mean, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(torch.tensor(got["0.running_var"], dtype=torch.float64), var, rtol=0, atol=TOLERANCE)
    # ... and the rule is not one device's variance
    assert (torch.tensor(got["0.running_var"], dtype=torch.float64) - one_device_var).abs().max() > 1e-3
    assert got["0.num_batches_tracked"] == steps


@pytest.mark.timeout(150)
def test_the_per_step_agreement_check_names_a_parameter_written_on_one_worker_only(tmp_path):
    # At step 5 slot 1 adds 1 to the last layer's bias before backward: the MultiWorkerMirrored agreement
    # check at the commit point names it on every member, and the step is discarded everywhere.
    workers, results = _run(tmp_path, [], max_restarts=0, diverge=5)
    assert len(results) == 3 and [w.returncode for w in workers] == [3, 3, 3]
    for r in results:
        assert r["steps"] == 5 and r["applied"] == list(range(5)), (r["slot"], r["applied"])
        # The generation's 6th step (its ranks are the registration order: slot 1 may be rank 0, then the
        # message names the other two as differing from it).
        assert r["error"].startswith("ReplicaDivergenceError: The parameter Sequential.2.bias differs between "
                                     "the ranks at optimizer step 6: rank"), r["error"]
        assert "written in place outside the optimizer" in r["error"], r["error"]
