"""ClusterCoordinator semantics, ported from TF's cluster_coordinator_test.py.

One cluster (chief, 1 ps, 2 workers as local processes) runs every scenario once; the tests below check
what it observed. The chief's observations are plain data returned through the harness.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from _ps_bodies import assert_no_process_left
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.errors import CancelledError, UnavailableError

psutil = pytest.importorskip("psutil", reason="needs psutil, from the test extra: pip install -e '.[test]'")
os.environ.setdefault("TORCHSTRATEGIES_PS_SECRET", "test-job-secret-0123456789abcdef")   # the launch sets it


def _worker_index() -> int:
    return int(os.environ["RANK"]) - 2       # ranks: 0 chief, 1 ps, 2 and 3 workers


def _double(x):
    return x * 2


def _boom():
    raise ValueError("boom from a closure")


def _sleepy(i, seconds):
    time.sleep(seconds)
    return i


def _dataset_fn(ctx):
    # TF 2.21: every worker gets one input pipeline with id 0; the worker index is our extension.
    seen = (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_workers)
    start = 1000 * ctx.worker_index
    return ((seen, i) for i in range(start, start + 1000))


def _next_with_worker(it):
    time.sleep(0.02)
    return _worker_index(), next(it)


def _echo_with_worker(v):
    return _worker_index(), v


def _variable(strategy, value, aggregation=None, name=None):
    """ts.Variable under the scope: a PSVariable on a ps."""
    v = ts.Variable(value, name=name) if aggregation is None else ts.Variable(value, aggregation=aggregation, name=name)
    assert type(v).__name__ == "PSVariable" and ts.get_strategy() is strategy
    return v


def _increment(counter, table):
    counter.assign_add(1.0)
    table.assign_sub(torch.tensor([1.0, 2.0, 3.0]))
    time.sleep(0.01)


def _read(var):
    return var.read_value() + 1


def _scenarios(strategy):
    out = {}
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    out["singleton"] = ts.coordinator.ClusterCoordinator(strategy) is coordinator

    # schedule / join / done; RemoteValue states and fetch/get.
    slow = coordinator.schedule(_sleepy, args=(7, 1.0))
    out["done_while_running"] = coordinator.done()
    out["status_before"] = slow.status.value
    rvs = [coordinator.schedule(_double, args=(torch.tensor(float(i)),)) for i in range(6)]
    coordinator.join()
    out["done_after_join"] = coordinator.done()
    out["status_after"] = slow.status.value
    out["values_get"] = [(type(rv.get()).__name__, float(rv.get())) for rv in rvs]   # plain data back
    out["values_fetch"] = [rv.fetch() for rv in rvs]
    out["slow"] = slow.fetch()

    # The first error is raised once by join, then cleared; queued closures are cancelled.
    bad = coordinator.schedule(_boom)
    queued = [coordinator.schedule(_sleepy, args=(i, 0.3)) for i in range(8)]
    try:
        coordinator.join()
        out["join_error"] = None
    except ValueError as e:
        out["join_error"] = str(e)
    coordinator.join()                       # cleared: no error the second time
    out["second_join_ok"] = True
    try:
        bad.fetch()
    except ValueError as e:
        out["bad_fetch"] = str(e)
    outcomes = []
    for rv in queued:
        try:
            outcomes.append(("value", rv.fetch()))
        except CancelledError:
            outcomes.append(("cancelled", None))
    out["queued_outcomes"] = outcomes
    out["after_error"] = coordinator.schedule(_double, args=(21,)).fetch()

    # The pending error is raised by the next schedule instead (once), and done() raises it too.
    for key, call in (("schedule_error", lambda: coordinator.schedule(_double, args=(1,))),
                      ("done_error", coordinator.done)):
        bad = coordinator.schedule(_boom)
        try:
            bad.fetch()
        except ValueError:
            pass
        try:
            call()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
        coordinator.join()
    out["done_cleared"] = coordinator.done()

    # Bad inputs.
    for name, call in [("not_callable", lambda: coordinator.schedule(3)),
                       ("remote_value_arg", lambda: coordinator.schedule(_double, args=(rvs[0],)))]:
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)

    # Per-worker datasets: each worker iterates its own dataset, keeping its position across closures.
    per_worker_iter = iter(coordinator.create_per_worker_dataset(_dataset_fn))
    drawn = [coordinator.schedule(_next_with_worker, args=(per_worker_iter,)) for _ in range(16)]
    coordinator.join()
    out["drawn"] = [rv.fetch() for rv in drawn]
    pwv = ts.coordinator.PerWorkerValues(["for worker 0", "for worker 1"])
    echoes = [coordinator.schedule(_echo_with_worker, args=(pwv,)) for _ in range(6)]
    coordinator.join()
    out["echoes"] = [rv.fetch() for rv in echoes]

    # Assignment and aggregation: in-place writes in closures reach the ps; concurrent gradient pushes
    # from both workers are all applied (none lost).
    with strategy.scope():
        counter = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            counter.weight.fill_(0.0)
        opt = torch.optim.SGD(counter.parameters(), lr=1.0)

    def assign_add():
        with torch.no_grad():
            counter.weight.add_(1.0)

    for _ in range(3):
        coordinator.schedule(assign_add).fetch()
    coordinator.join()                       # join() refreshes the chief's copies of the parameters
    out["after_assign_add"] = float(counter.weight.detach().reshape(()))
    with torch.no_grad():
        counter.weight.fill_(10.0)           # a chief-side assignment reaches the ps before the next closure

    def minus_one_step():
        opt.zero_grad()
        counter(torch.ones(1, 1)).sum().backward()   # d/dw (w * 1) = 1, so SGD(lr=1) subtracts 1
        opt.step()
        time.sleep(0.01)

    for _ in range(20):
        coordinator.schedule(minus_one_step)
    coordinator.join()
    out["after_pushes"] = float(counter.weight.detach().reshape(()))
    out["locations"] = strategy.parameter_locations(counter.weight)

    # Variables live on a ps; assign_add runs on the ps, so concurrent increments are never lost.
    with strategy.scope():
        steps = _variable(strategy, torch.tensor(0.0), name="steps")
        table = _variable(strategy, torch.zeros(3), name="table")
    for _ in range(20):
        coordinator.schedule(_increment, args=(steps, table))
    coordinator.join()
    out["steps_after_increments"] = float(steps)
    out["table_after_increments"] = table.read_value().tolist()
    steps.assign(100.0)                          # a chief assignment, seen by the next closure
    out["read_in_closure"] = coordinator.schedule(_read, args=(steps,)).fetch().item()
    try:
        with strategy.scope():
            _variable(strategy, torch.tensor(1), aggregation="MEAN")
        out["int_mean"] = None
    except ValueError as e:
        out["int_mean"] = str(e)

    # A worker task that dies and comes back (new address) is reconnected and used again; its in-flight
    # closure is re-run elsewhere.
    restart = [coordinator.schedule(_stop_my_server_once) for _ in range(24)]
    coordinator.join()
    out["restart"] = [rv.fetch() for rv in restart]
    return out


_SERVER: dict = {}


def _stop_my_server_once():
    """Run on a worker: the first time, stops this worker's server (as if the task died) and waits."""
    if _worker_index() == 1 and _SERVER["generation"] == 1:
        threading.Thread(target=_SERVER["server"].stop, daemon=True).start()
        time.sleep(10)                       # never returns: the chief sees the connection close first
    time.sleep(0.3)
    return _worker_index(), _SERVER["generation"]


def _cluster(rank, world_size, body):
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=world_size - 3)
    if resolver.task_type != "chief":
        _SERVER["generation"] = 0
        while True:                          # a worker whose server stops comes back as a new task
            _SERVER["generation"] += 1
            server = ts.distribute.Server(resolver, timeout=60, lease_timeout=30)
            _SERVER["server"] = server
            server.join()
            if server._shutdown_requested:
                return resolver.task_type
    strategy = ts.ParameterServerStrategy(resolver, timeout=30)
    try:
        return body(strategy)
    finally:
        strategy.shutdown()


@pytest.fixture(scope="module")
def observed():
    results = run_ranks(_cluster, 4, args=(_scenarios,), init_process_group=False, timeout=150)
    assert results[1:] == ["ps", "worker", "worker"]          # every server returned after the shutdown
    assert_no_process_left()
    return results[0]


@pytest.mark.timeout(200)
def test_schedule_join_done_and_remote_value_states(observed):
    assert observed["singleton"] is True
    assert observed["done_while_running"] is False
    assert observed["status_before"] in ("NOT_READY",)
    assert observed["done_after_join"] is True
    assert observed["status_after"] == "READY"
    assert observed["values_get"] == [("Tensor", 2.0 * i) for i in range(6)]
    assert [float(v) for v in observed["values_fetch"]] == [2.0 * i for i in range(6)]
    assert all(type(v).__module__ == "numpy" for v in observed["values_fetch"])
    assert observed["slow"] == 7


def test_first_error_raised_once_by_join_then_cleared(observed):
    assert "boom from a closure" in observed["join_error"]
    assert observed["second_join_ok"] is True
    assert "boom from a closure" in observed["bad_fetch"]
    assert observed["after_error"] == 42


def test_queued_closures_are_cancelled_after_an_error(observed):
    kinds = [k for k, _ in observed["queued_outcomes"]]
    # At most one of them could start on the other worker before the failure was seen; the rest were cancelled.
    assert kinds.count("cancelled") >= 6
    for kind, value in observed["queued_outcomes"]:
        assert kind == "cancelled" or value in range(8)


def test_pending_error_raised_by_next_schedule_or_done(observed):
    assert "boom from a closure" in observed["schedule_error"]
    assert "boom from a closure" in observed["done_error"]
    assert observed["done_cleared"] is True


def test_bad_schedule_inputs_raise_value_error(observed):
    assert "callable" in observed["not_callable"]
    assert "RemoteValue" in observed["remote_value_arg"]


def test_per_worker_datasets_iterate_independently(observed):
    per_worker: dict[int, list[int]] = {0: [], 1: []}
    for worker, (seen, value) in observed["drawn"]:
        assert seen == (1, 0, 2)  # TF's InputContext(num_input_pipelines=1, input_pipeline_id=0); 2 workers
        per_worker[worker].append(value)
    assert sum(len(v) for v in per_worker.values()) == 16
    for worker, values in per_worker.items():
        # Each worker draws from its own dataset (sharded by ctx.worker_index), in order, no repeats.
        assert values == list(range(1000 * worker, 1000 * worker + len(values)))


def test_per_worker_values_select_the_workers_element(observed):
    for worker, value in observed["echoes"]:
        assert value == f"for worker {worker}"


def test_assignment_and_concurrent_updates_reach_the_ps(observed):
    assert observed["after_assign_add"] == 3.0
    assert observed["after_pushes"] == 10.0 - 20
    assert observed["locations"] == [(0, 0, 1)]


def test_server_rejects_chief_role_and_strategy_rejects_non_chief():
    spec = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}
    chief = ts.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0)
    worker = ts.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="chief"):
        ts.distribute.Server(chief, start=False)
    with pytest.raises(ValueError, match="Server"):
        ts.ParameterServerStrategy(worker)
    no_ps = ts.cluster_resolver.SimpleClusterResolver({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:3"]},
                                                      task_type="chief", task_id=0)
    with pytest.raises(ValueError, match="ps"):
        ts.ParameterServerStrategy(no_ps)


def test_unreachable_cluster_raises_unavailable_within_timeout():
    from harness import free_port

    spec = {"chief": [f"127.0.0.1:{free_port()}"], "ps": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]}
    chief = ts.cluster_resolver.SimpleClusterResolver(spec, task_type="chief", task_id=0)
    with pytest.raises(UnavailableError, match="ps:0"):
        ts.ParameterServerStrategy(chief, timeout=1.0)


def test_variables_live_on_ps_and_updates_are_atomic(observed):
    assert observed["steps_after_increments"] == 20.0
    assert observed["table_after_increments"] == [-20.0, -40.0, -60.0]
    assert observed["read_in_closure"] == 101.0
    assert "MEAN" in observed["int_mean"]


def test_a_worker_that_comes_back_is_reconnected(observed):
    results = observed["restart"]
    assert len(results) == 24                                   # every closure completed (one of them twice)
    assert (1, 1) not in results                                # worker 1's first server never returned one
    assert (1, 2) in results                                    # its second incarnation ran closures
