"""The caller's torch modes reach every replica thread, replica threads are persistent workers, and
GradScaler follows TF's LossScaleOptimizer rule under the in-process strategies."""

from __future__ import annotations

import threading

import pytest
import torch

import torchstrategies as ts

STRATEGIES = {
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _modes() -> tuple:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
        torch.get_num_threads(),
    )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_autocast_no_grad_and_inference_mode_around_run_reach_every_replica(name):
    s = STRATEGIES[name]()
    with s.scope():
        lin = torch.nn.Linear(4, 4)
    threads = torch.get_num_threads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = s.experimental_local_results(s.run(lambda: (_modes(), lin(torch.ones(2, 4)).dtype)))
    assert all(o == ((True, False, True, torch.bfloat16, threads), torch.bfloat16) for o in outs)
    with torch.no_grad():
        outs = s.experimental_local_results(s.run(lambda: (_modes(), lin(torch.ones(2, 4)).requires_grad)))
    assert all(o == ((False, False, False, None, threads), False) for o in outs)
    with torch.inference_mode():
        outs = s.experimental_local_results(s.run(lambda: (_modes(), lin(torch.ones(2, 4)).is_inference())))
    assert all(o == ((False, True, False, None, threads), True) for o in outs)
    outs = s.experimental_local_results(s.run(_modes))  # and nothing sticks to the persistent workers
    assert all(o == (True, False, False, None, threads) for o in outs)


def _modes_after_a_sync_point() -> tuple:
    rc = ts.get_replica_context()
    before = _modes()
    rc.merge_call(lambda strategy: None)  # every replica pauses and resumes on its thread
    return before, _modes(), rc.replica_id_in_sync_group


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("sync", [False, True], ids=["no-merge", "merge"])
def test_modes_reach_every_replica_and_do_not_leak(name, sync):
    s = STRATEGIES[name]()
    fn = _modes_after_a_sync_point if sync else (lambda: (_modes(), _modes(), None))
    threads = torch.get_num_threads()
    cases = [
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16), (True, False, True, torch.bfloat16, threads)),
        (torch.no_grad, (False, False, False, None, threads)),
        (torch.inference_mode, (False, True, False, None, threads)),
    ]
    for make, want in cases:
        with make():
            outs = s.experimental_local_results(s.run(fn))
        assert [o[:2] for o in outs] == [(want, want)] * len(outs)

    def leaks():  # replica 0 switches grad mode off for good; neither replica 1 nor the caller sees it
        before = _modes()
        if ts.get_replica_context().replica_id_in_sync_group == 0:
            torch.set_grad_enabled(False)
        if sync:
            ts.get_replica_context().merge_call(lambda strategy: None)
        return before

    outs = s.experimental_local_results(s.run(leaks))
    assert all(o == (True, False, False, None, threads) for o in outs)
    assert torch.is_grad_enabled()


def test_replica_threads_are_reused_across_runs_and_after_an_error():
    s = ts.MirroredStrategy(num_replicas=3)

    def ident():
        ts.get_replica_context().merge_call(lambda strategy: None)
        return threading.get_ident()

    first = s.experimental_local_results(s.run(ident))
    assert first[0] == threading.get_ident()  # replica 0 runs in the calling thread
    assert len(set(first)) == 3

    def fail():
        if ts.get_replica_context().replica_id_in_sync_group == 1:
            raise KeyError("replica 1 failed")
        ts.get_replica_context().merge_call(lambda strategy: None)

    with pytest.raises(KeyError, match="replica 1 failed"):
        s.run(fail)
    for _ in range(3):
        assert set(s.experimental_local_results(s.run(ident))) == set(first)


def test_replica_0_runs_in_the_calling_thread_and_every_other_replica_on_a_thread_of_its_own():
    s = ts.MirroredStrategy(num_replicas=3)
    for sync in (False, True):  # with or without a merge_call: one schedule

        def fn(sync=sync):
            if sync:
                ts.get_replica_context().merge_call(lambda strategy: None)
            return threading.get_ident(), ts.get_replica_context().replica_id_in_sync_group

        outs = s.experimental_local_results(s.run(fn))
        assert outs[0] == (threading.get_ident(), 0)
        assert [i for _, i in outs] == [0, 1, 2] and len({t for t, _ in outs}) == 3


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_grad_scaler_skips_the_step_on_every_replica_when_one_replica_overflows(name):
    s = STRATEGIES[name]()
    with s.scope():
        lin = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in lin.parameters()]

    def step(bad_replica):
        opt.zero_grad()
        x = torch.ones(1, 2)
        if ts.get_replica_context().replica_id_in_sync_group == bad_replica:
            x = x * float("inf")
        scaler.scale(ts.compute_average_loss(lin(x).sum(1), global_batch_size=2)).backward()
        scaler.step(opt)
        scaler.update()
        return torch.tensor(scaler.get_scale())

    scales = s.experimental_local_results(s.run(step, args=(1,)))
    assert [float(v) for v in scales] == [2.0] * len(scales)  # halved once, equal everywhere
    for p, b in zip(lin.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), b)  # nobody stepped
    s.run(step, args=(-1,))
    assert scaler.get_scale() == 2.0
    assert not torch.equal(lin.weight.detach(), before[0])  # a finite step is applied
