"""Pieces the parameter-server tests share (imported by the test modules and by their rank processes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchstrategies as ts


def counter_model(strategy) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A 1x1 linear model made in ``strategy``'s scope with its weight at 0 and SGD at lr 1, and a step
    that lowers the weight by exactly 1: after k applied steps the weight is -k (a replayed or lost step
    shows in the count)."""
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(1, 1)).sum().backward()
        opt.step()

    return model, opt, step


def serve_or_train(resolver, body, **strategy_kwargs):
    """What each rank of a parameter-server test cluster runs: a ps or worker task serves until the chief
    shuts the cluster down and returns its task type; the chief runs ``body(strategy)`` on a
    ``ParameterServerStrategy(resolver, **strategy_kwargs)`` and shuts the cluster down."""
    if resolver.task_type != "chief":
        ts.distribute.Server(resolver, timeout=60, lease_timeout=30).join()
        return resolver.task_type
    strategy = ts.ParameterServerStrategy(resolver, **strategy_kwargs)
    try:
        return body(strategy)
    finally:
        strategy.shutdown()


def assert_no_process_left() -> None:
    """No child process of the test (but multiprocessing's resource tracker) outlived the cluster."""
    psutil = pytest.importorskip("psutil", reason="needs psutil, from the test extra: pip install -e '.[test]'")
    leftovers = [p for p in psutil.Process().children(recursive=True)
                 if "resource_tracker" not in " ".join(p.cmdline())]
    assert leftovers == []
