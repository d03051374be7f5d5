"""How MirroredStrategy schedules its replicas: replica 0 in the calling thread, every other replica on a
thread of its own, one at a time; every merge_call runs once, in the calling thread; mismatches and errors
raise named errors and leave the strategy usable."""

from __future__ import annotations

import threading

import pytest
import torch

import torchstrategies as ts
from tests._mirrored_common import all_but_one_merge
from tests._mirrored_common import replica_id as _rid


def _record_merge(seen):
    def merge_fn(strategy, value):
        seen["merge"].append(threading.get_ident())
        seen["args"].append(tuple(strategy.experimental_local_results(value)))
        return value

    return merge_fn


def _recording_exits(body, exited):
    """``body`` as a replica function that appends each replica's id to ``exited`` as the replica leaves it,
    returning or raising (a stopped replica unwinds its function)."""

    def fn():
        try:
            return body()
        finally:
            exited.append(_rid())

    return fn


def _seen():
    """What the replicas and merges record (reaching fn by closure: a dict in ``args`` is mapped per replica)."""
    return {"replica": [], "merge": [], "args": []}


@pytest.mark.timeout(30)
def test_a_replica_that_syncs_after_replica_0_finished_without_syncing_is_named():
    s = ts.MirroredStrategy(num_replicas=3)
    finished = []

    def only_replica_2_syncs():
        if _rid() == 2:
            ts.get_replica_context().all_reduce("sum", torch.ones(1))
        return _rid()

    with pytest.raises(RuntimeError, match=r"different number of replica_context\(\)\.merge_call\(\) calls: "
                       r"replicas \[0, 1\] finished while replicas \[2\] wait in merge_call\(.*all_reduce"):
        s.run(_recording_exits(only_replica_2_syncs, finished))  # replica 2 is stopped: it unwinds
    assert sorted(finished) == [0, 1, 2]
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)  # still usable


@pytest.mark.timeout(30)
def test_the_mismatch_error_wins_even_when_a_replica_swallows_it():
    s = ts.MirroredStrategy(num_replicas=2)

    def swallow():
        try:
            ts.get_replica_context().merge_call(lambda strategy: None)
        except RuntimeError:
            pass
        if _rid() == 0:
            ts.get_replica_context().merge_call(lambda strategy: None)  # replica 1 never makes this one
        return 0

    with pytest.raises(RuntimeError, match=r"replicas \[1\] finished while replicas \[0\] wait"):
        s.run(swallow)


@pytest.mark.timeout(30)
def test_a_replica_that_finishes_while_replica_0_waits_in_merge_call_is_named():
    s = ts.MirroredStrategy(num_replicas=3)
    with pytest.raises(RuntimeError, match=r"replicas \[1\] finished while replicas \[0, 2\] wait in merge_call"):
        s.run(all_but_one_merge(skipper=1))
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2, 3])
def test_every_merge_runs_once_in_the_calling_thread_and_each_replica_gets_its_part(n):
    s = ts.MirroredStrategy(num_replicas=n)
    me = threading.get_ident()
    seen = _seen()
    parts = {}

    def then_more():
        part = ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        seen["replica"].append(threading.get_ident())
        parts[_rid()] = part

    def in_try():
        try:
            ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        except KeyError:
            pass

    def ends_fn():
        ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))

    for fn in (then_more, in_try, ends_fn):
        seen.update(_seen())
        s.run(fn)
        assert seen["args"] == [tuple(range(n))], fn.__name__
        assert seen["merge"] == [me], fn.__name__
    assert parts == {i: i for i in range(n)}


@pytest.mark.timeout(30)
def test_a_failing_merge_or_replica_raises_its_error_and_the_strategy_stays_usable():
    s = ts.MirroredStrategy(num_replicas=3)
    unwound = []

    def failing_merge():
        ts.get_replica_context().merge_call(lambda strategy: {}["key"])

    with pytest.raises(KeyError, match="key"):
        s.run(_recording_exits(failing_merge, unwound))
    assert sorted(unwound) == [0, 1, 2]

    def replica_2_fails():
        if _rid() == 2:
            raise ValueError("replica 2 failed")
        ts.get_replica_context().merge_call(lambda strategy: None)

    with pytest.raises(ValueError, match="replica 2 failed"):
        s.run(replica_2_fails)
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_backward_only_runs_steps_in_run_and_code_after_the_step_equal_one_device(n):
    """The same training written four ways: backward-only runs with the step outside run; the step ending
    the step function; the step with code after it; and with merge_call_timeout set. All equal one device
    exactly in float64."""
    torch.manual_seed(0)
    data = [(torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)) for _ in range(3)]

    def make(strategy):
        with strategy.scope():
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt

    def loss(model, x, y):
        return ts.compute_average_loss((model(x) - y).pow(2).sum(1), global_batch_size=6)

    def train(schedule):
        s = ts.OneDeviceStrategy("cpu") if schedule == "one_device" else ts.MirroredStrategy(num_replicas=n)
        if schedule == "timeout":
            s.extended.merge_call_timeout = 60.0
        model, opt = make(s)

        def backward_only(x, y):
            opt.zero_grad()
            loss(model, x, y).backward()

        def step(x, y):
            backward_only(x, y)
            opt.step()

        def step_then_more(x, y):
            backward_only(x, y)
            opt.step()
            return model[0].weight.detach().clone()  # read after the update: every replica sees it

        for x, y in s.experimental_distribute_dataset(data):
            if schedule == "backward_only":
                s.run(backward_only, args=(x, y))
                opt.step()
            elif schedule == "step_then_more":
                seen = s.experimental_local_results(s.run(step_then_more, args=(x, y)))
                assert all(torch.equal(w, model[0].weight.detach()) for w in seen)
            else:
                s.run(step, args=(x, y))
        return [p.detach().clone() for p in model.parameters()]

    want = train("one_device")
    for schedule in ("backward_only", "step", "step_then_more", "timeout"):
        for g, w in zip(train(schedule), want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=schedule)


def test_per_replica_values_inside_a_registered_pytree_node_are_unwrapped_per_replica():
    import dataclasses

    from torch.utils import _pytree as pytree

    @dataclasses.dataclass
    class Batch:
        x: object

    pytree.register_dataclass(Batch)
    for s in (ts.OneDeviceStrategy("cpu"), ts.MirroredStrategy(num_replicas=2)):
        v = s.experimental_distribute_values_from_function(
            lambda c: torch.tensor(float(c.replica_id_in_sync_group))
        )
        out = s.experimental_local_results(s.run(lambda b: b.x * 2, args=(Batch(v),)))
        assert [float(o) for o in out] == [2.0 * i for i in range(s.num_replicas_in_sync)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_local_gradient_sum_is_bit_for_bit_the_cross_device_ops_reduction(dtype):
    """On one device the gradients are summed directly (foreach adds for float32/float64, the kernel for
    the others); a ReductionToOneDevice with an explicit device takes the general batch_reduce path."""
    torch.manual_seed(0)
    x = torch.randn(9, 5).to(dtype)
    got = []
    for ops in (None, ts.ReductionToOneDevice(reduce_to_device="cpu")):
        s = ts.MirroredStrategy(num_replicas=3, cross_device_ops=ops)
        with s.scope():
            torch.manual_seed(1)
            model = torch.nn.Linear(5, 3).to(dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def step(xb):
            opt.zero_grad()
            model(xb).pow(2).sum().backward()
            opt.step()

        xs = s.experimental_distribute_values_from_function(lambda c: x[3 * c.replica_id_in_sync_group :][:3])
        s.run(step, args=(xs,))
        got.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(30)
def test_ctrl_c_interrupts_run_while_a_replica_never_pauses():
    """The scheduler waits for a replica without the GIL (csrc/cpu/replica_threads.cpp) yet runs Python's
    signal handlers: SIGINT raises KeyboardInterrupt in the caller while replica 1 is still busy."""
    import os
    import signal

    s = ts.MirroredStrategy(num_replicas=2)
    release = threading.Event()

    def busy():
        if _rid() == 1:
            release.wait(20)  # until the test lets it go (bounded)

    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            s.run(busy)
        assert not release.is_set()  # interrupted while replica 1 still waited, not after it returned
    finally:
        release.set()
        timer.cancel()
    assert s.experimental_local_results(s.run(_rid)) == (0, 1)  # (a fresh worker: the interrupted one is left)


def test_the_baton_hands_over_both_ways_and_a_resume_past_its_timeout_is_false():
    from torchstrategies._ext import _C

    baton, turns = _C.Baton(), []

    def worker():
        baton.wait()
        for i in range(3):
            turns.append(f"worker {i}")
            baton.pause()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    for i in range(3):
        assert baton.resume(None)
        turns.append(f"scheduler {i}")
    assert turns == [x for i in range(3) for x in (f"worker {i}", f"scheduler {i}")]
    assert baton.resume(0.05) is False  # the worker never pauses again
