"""How MirroredStrategy schedules its replicas: replica 0 in the calling thread, the others in it too when
no replica reaches a sync point, on worker threads when replica 0 does; mismatches raise named errors."""

from __future__ import annotations

import threading

import pytest
import torch

import torchstrategies as ts


def _rid() -> int:
    return ts.get_replica_context().replica_id_in_sync_group


@pytest.mark.timeout(30)
def test_a_replica_that_syncs_after_replica_0_finished_without_syncing_is_named():
    s = ts.MirroredStrategy(num_replicas=3)

    def only_replica_2_syncs():
        if _rid() == 2:
            ts.get_replica_context().all_reduce("sum", torch.ones(1))
        return _rid()

    with pytest.raises(RuntimeError, match=r"different number of replica_context\(\)\.merge_call\(\) calls: "
                       r"replica 2 called merge_call\(.*all_reduce.*\) but replica 0 finished without any"):
        s.run(only_replica_2_syncs)
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)  # still usable


@pytest.mark.timeout(30)
def test_the_mismatch_error_wins_even_when_the_replica_swallows_it():
    s = ts.MirroredStrategy(num_replicas=2)

    def swallow():
        if _rid() == 1:
            try:
                ts.get_replica_context().merge_call(lambda strategy: None)
            except RuntimeError:
                pass
        return 0

    with pytest.raises(RuntimeError, match="replica 1 called merge_call"):
        s.run(swallow)


@pytest.mark.timeout(30)
def test_a_replica_that_finishes_while_replica_0_waits_in_merge_call_is_named():
    s = ts.MirroredStrategy(num_replicas=3)

    def replica_1_skips():
        if _rid() != 1:
            ts.get_replica_context().merge_call(lambda strategy: None)
        return 0

    with pytest.raises(RuntimeError, match=r"replicas \[1\] finished while replicas \[0, 2\] wait in merge_call"):
        s.run(replica_1_skips)
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_calling_thread_path_equals_worker_path_equals_one_device(n):
    """Four schedules of the same training: backward-only runs (no sync point: every replica in the
    calling thread) with the step outside run; the step ending the step function (every replica in the
    calling thread, the merge deferred to the last); the step with code after it (replica 0 waits in
    merge_call: workers); and every replica on a worker (merge_call_timeout set). All equal one device
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
        if schedule == "workers":
            s.extended.merge_call_timeout = 60.0
        model, opt = make(s)
        threads = set()

        def backward_only(x, y):
            threads.add(threading.get_ident())
            opt.zero_grad()
            loss(model, x, y).backward()

        def step(x, y):  # optimizer.step() ends fn: each replica ends at it, the last one merges
            threads.add(threading.get_ident())
            backward_only(x, y)
            opt.step()

        def step_then_more(x, y):  # code after the step: replicas 1.. wait in merge_call on workers
            backward_only(x, y)
            opt.step()
            threads.add(threading.get_ident())

        for x, y in s.experimental_distribute_dataset(data):
            if schedule == "calling_thread":
                s.run(backward_only, args=(x, y))
                opt.step()
            elif schedule == "replica_0_syncs":
                s.run(step_then_more, args=(x, y))
            else:
                s.run(step, args=(x, y))
        return [p.detach().clone() for p in model.parameters()], threads

    want, _ = train("one_device")
    schedules = (("calling_thread", 1), ("step_ends_fn", 1), ("replica_0_syncs", n), ("workers", n))
    for schedule, n_threads in schedules:
        got, threads = train(schedule)
        assert len(threads) == n_threads, schedule
        for g, w in zip(got, want, strict=True):
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


def _record_merge(seen):
    def merge_fn(strategy, value):
        seen["merge"].append(threading.get_ident())
        seen["args"].append(tuple(strategy.experimental_local_results(value)))
        return value

    return merge_fn


def _seen():
    """What the replicas and merges record (reaching fn by closure: a dict in ``args`` is mapped per replica)."""
    return {"replica": [], "merge": [], "args": []}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", [2, 3])
def test_a_merge_call_that_ends_the_replica_function_runs_once_in_the_calling_thread(n):
    s = ts.MirroredStrategy(num_replicas=n)
    seen = _seen()

    def fn():
        seen["replica"].append(threading.get_ident())
        ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))

    s.run(fn)
    me = threading.get_ident()
    assert seen["replica"] == [me] * n and seen["merge"] == [me]
    assert seen["args"] == [tuple(range(n))]


@pytest.mark.timeout(30)
def test_code_after_a_merge_call_or_a_handler_around_it_keeps_the_worker_schedule():
    s = ts.MirroredStrategy(num_replicas=2)
    me = threading.get_ident()
    seen = _seen()

    def then_more():
        ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        seen["replica"].append(threading.get_ident())

    def in_try():
        try:
            ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        except KeyError:
            pass

    def result_used():
        return ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))

    for fn in (then_more, in_try, result_used):
        seen.update(_seen())
        s.run(fn)
        assert seen["args"] == [(0, 1)], fn.__name__
        assert seen["merge"] != [me], fn.__name__  # the last replica, on its worker, merged


@pytest.mark.timeout(30)
def test_replica_0_ends_at_its_merge_call_while_replica_1_waits_in_the_calling_thread_for_replica_2():
    s = ts.MirroredStrategy(num_replicas=3)
    seen = _seen()
    parts = {}

    def fn():
        if _rid() == 0:
            ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        else:
            part = ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
            parts[_rid()] = (part, threading.get_ident())

    s.run(fn)
    assert seen["args"] == [(0, 1, 2)]
    me = threading.get_ident()
    assert parts[1] == (1, me) and parts[2][0] == 2 and parts[2][1] != me


@pytest.mark.timeout(30)
def test_deferred_merge_calls_that_a_replica_never_makes_are_named_and_a_failing_merge_raises():
    s = ts.MirroredStrategy(num_replicas=3)
    me = threading.get_ident()
    threads = []

    def replica_1_skips():
        threads.append(threading.get_ident())
        if _rid() != 1:
            ts.get_replica_context().merge_call(lambda strategy: None)

    with pytest.raises(RuntimeError, match=r"replicas \[1\] finished while replicas \[0, 2\] wait in merge_call"):
        s.run(replica_1_skips)
    assert threads == [me] * 3  # each ended at its merge_call, in the calling thread

    def failing_merge():
        ts.get_replica_context().merge_call(lambda strategy: threads.append(threading.get_ident()) or {}["key"])

    threads.clear()
    with pytest.raises(KeyError, match="key"):
        s.run(failing_merge)
    assert threads == [me]
    assert s.experimental_local_results(s.run(_rid)) == (0, 1, 2)  # still usable


@pytest.mark.timeout(60)
def test_returning_a_detached_loss_after_the_step_keeps_the_calling_thread_and_the_same_results():
    """``return loss.detach()`` (and ``.item()``) after ``optimizer.step()``, the README's step: no worker
    runs it when ``loss`` is a tensor, and parameters and results equal the worker schedule's; an object
    of another type with a ``detach`` method keeps the worker schedule (its method could see the merge)."""
    me = threading.get_ident()

    def train(tail: str, timeout: float | None) -> tuple[list[torch.Tensor], list, list[int]]:
        s = ts.MirroredStrategy(num_replicas=2)
        s.extended.merge_call_timeout = timeout  # set: every replica on a worker (the reference schedule)
        with s.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        merges: list[int] = []
        apply = s.extended._apply_optimizer_step

        def spy(o, closure):
            merges.append(threading.get_ident())
            return apply(o, closure)

        s.extended._apply_optimizer_step = spy

        def backward(xb):
            loss = ts.compute_average_loss(model(xb).pow(2).sum(1), global_batch_size=8)
            opt.zero_grad()
            loss.backward()
            return loss

        # (the step and what follows it must be the replica function's own last lines)
        def detach(xb):
            loss = backward(xb)
            opt.step()
            return loss.detach()

        def item(xb):
            loss = backward(xb)
            opt.step()
            return loss.item()

        fn = detach if tail == "detach" else item
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        xs = s.experimental_distribute_values_from_function(lambda c: x.chunk(2)[c.replica_id_in_sync_group])
        results = [s.experimental_local_results(s.run(fn, args=(xs,))) for _ in range(3)]
        return [p.detach().clone() for p in model.parameters()], results, merges

    for tail in ("detach", "item"):
        params, results, merges = train(tail, None)
        ref_params, ref_results, ref_merges = train(tail, 30.0)
        assert merges == [me] * 3, tail  # merged in the calling thread: no worker ran a replica
        assert me not in ref_merges, tail
        for a, b in zip(params, ref_params, strict=True):
            assert torch.equal(a, b), tail
        assert [[float(v) for v in r] for r in results] == [[float(v) for v in r] for r in ref_results], tail

    s = ts.MirroredStrategy(num_replicas=2)
    seen = _seen()

    class Loss:
        def detach(self) -> int:
            return len(seen["merge"])  # what it returns depends on whether the merge already ran

    def not_a_tensor():
        loss = Loss()
        ts.get_replica_context().merge_call(_record_merge(seen), args=(_rid(),))
        return loss.detach()

    assert s.run(not_a_tensor) == 1  # every replica's detach() ran after the merge, as written
    assert seen["merge"] != [me]  # the last replica merged on its worker
