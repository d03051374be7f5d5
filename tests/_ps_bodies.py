"""Pieces the parameter-server tests share (imported by the test modules and by their rank processes)."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
