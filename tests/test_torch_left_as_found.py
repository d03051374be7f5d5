"""Strategies leave torch as they found it (issue 39): the patches a strategy needs (creation hooks,
wrapped Optimizer.__init__ / Module.__setstate__ / optimizer-class step, GradScaler and LRScheduler
methods, optimizer step pre-hooks) are installed while one lives and removed when the last one is shut
down or garbage collected; Lightning and Accelerate then run as in a process that never made one."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _torch_state import changes, snapshot
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.distribute import creation
from torchstrategies.strategies import mirrored


class _InheritsStep(torch.optim.SGD):
    """A user optimizer that inherits ``step``: wrapping it must not leave a ``step`` in its own dict."""


def _warm_torch() -> None:
    """What torch itself patches on first use (each optimizer class's step, on its first instance; dynamo's
    import), done before the snapshot so that only torchstrategies' changes are compared."""
    import torch._dynamo  # noqa: F401

    p = [torch.nn.Parameter(torch.zeros(1))]
    for cls in (torch.optim.SGD, torch.optim.Adam, _InheritsStep):
        cls(p, lr=0.1)


def _train_in(strategy: ts.distribute.Strategy) -> None:
    """A model, optimizer, scheduler and grad scaler made in the scope, one step with each."""
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters()),
                _InheritsStep(model.parameters(), lr=0.1)]
        sched = torch.optim.lr_scheduler.StepLR(opts[0], 1)
        scaler = torch.amp.GradScaler("cpu")

    def step(x: torch.Tensor) -> None:
        for o in opts:
            o.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(opts[0])
        for o in opts:
            scaler.step(o)
        scaler.update()
        sched.step()

    strategy.run(step, args=(torch.ones(4, 2),))


_IN_PROCESS = {
    "OneDeviceStrategy": lambda: ts.OneDeviceStrategy("cpu"),
    "MirroredStrategy": lambda: ts.MirroredStrategy(num_replicas=2),
    "CentralStorageStrategy": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _in_process_body(rank: int, world: int, kind: str) -> list[str]:
    """In a fresh process (no strategy of another test alive): make, use and delete one strategy."""
    _warm_torch()
    before = snapshot()
    strategy = _IN_PROCESS[kind]()
    assert creation.PATCHES.installed
    _train_in(strategy)
    assert changes(before, snapshot()), "the strategy should have patched torch while alive"
    gone = weakref.ref(strategy)
    del strategy
    gc.collect()
    assert gone() is None, "nothing should keep a deleted strategy alive"
    assert not creation.PATCHES.installed and not mirrored.PATCHES.installed
    return changes(before, snapshot())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(_IN_PROCESS))
def test_deleting_an_in_process_strategy_leaves_torch_as_found(kind):
    assert run_ranks(_in_process_body, 1, args=(kind,), init_process_group=False, timeout=110) == [[]]


def _two_strategies_body(rank: int, world: int) -> list[str]:
    _warm_torch()
    before = snapshot()
    first, second = ts.MirroredStrategy(num_replicas=2), ts.MirroredStrategy(num_replicas=2)
    _train_in(first)
    del first
    gc.collect()
    assert mirrored.PATCHES.installed
    _train_in(second)  # the first one gone, the second still trains with every patch in place
    del second
    gc.collect()
    return changes(before, snapshot())


@pytest.mark.timeout(120)
def test_patches_stay_while_any_strategy_lives():
    assert run_ranks(_two_strategies_body, 1, init_process_group=False, timeout=110) == [[]]


def _multi_worker_body(rank: int, world: int, how: str) -> list[str]:
    import torch.distributed as dist

    _warm_torch()
    before = snapshot()
    resolver = ts.cluster_resolver.TorchrunClusterResolver()
    strategy = ts.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    _train_in(strategy)
    assert changes(before, snapshot())
    if how == "shutdown":
        strategy.shutdown()
    else:
        pg_was_ours = strategy.extended._owns_process_group
        del strategy
        gc.collect()
        if pg_was_ours and dist.is_initialized():
            dist.destroy_process_group()
    return changes(before, snapshot())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["shutdown", "del"])
def test_a_multi_worker_strategy_leaves_torch_as_found(how):
    assert run_ranks(_multi_worker_body, 2, args=(how,), init_process_group=False, timeout=110) == [[], []]


def _ps_body(rank: int, world: int) -> list[str] | str:
    from _ps_bodies import serve_or_train

    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type != "chief":
        return serve_or_train(resolver, lambda s: None)
    _warm_torch()
    before = snapshot()
    strategy = ts.ParameterServerStrategy(resolver, timeout=30)
    try:
        with strategy.scope():
            torch.nn.Linear(2, 1)
        assert changes(before, snapshot())
    finally:
        strategy.shutdown()
    return changes(before, snapshot())


@pytest.mark.timeout(150)
def test_a_parameter_server_strategy_leaves_torch_as_found_after_shutdown():
    secret = {"TORCHSTRATEGIES_PS_SECRET": "test-job-secret-0123456789abcdef"}  # the launch sets it
    assert run_ranks(_ps_body, 3, init_process_group=False, timeout=140, env=secret)[0] == []
