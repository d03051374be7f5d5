"""Nothing is written on the user's optimizer (issue 50): which strategy's scope made it is kept by the
creation tracker (``creation.OPTIMIZERS``), which of them step as a merge_call by the in-process strategy
(``MirroredExtended._optimizers``), both keyed weakly by the optimizer."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torchstrategies as ts
from torchstrategies.distribute import creation

_KINDS = {
    "OneDeviceStrategy": lambda: ts.OneDeviceStrategy("cpu"),
    "MirroredStrategy": lambda: ts.MirroredStrategy(num_replicas=2),
    "CentralStorageStrategy": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_an_optimizer_made_in_a_scope_has_the_attributes_of_one_made_outside(kind):
    plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    strategy = _KINDS[kind]()
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    strategy.run(_step, args=(model, opt))
    _step(model, opt)

    assert sorted(vars(opt)) == sorted(vars(plain))  # main wrote _torchstrategies_seen/_owner/_replicated
    assert creation.OPTIMIZERS.owner(opt) is strategy.extended
    assert creation.OPTIMIZERS.made_in_a_scope(opt) and not creation.OPTIMIZERS.made_in_a_scope(plain)


def test_an_optimizer_does_not_keep_its_strategys_replicas_alive():
    strategy = ts.MirroredStrategy(num_replicas=2)
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy.run(_step, args=(model, opt))
    replicas = weakref.ref(strategy.extended._replicated)

    del strategy
    gc.collect()

    assert replicas() is None  # main's opt._torchstrategies_replicated kept every replica's copies alive
    assert creation.OPTIMIZERS.made_in_a_scope(opt) and creation.OPTIMIZERS.owner(opt) is None
    _step(model, opt)  # a plain step now


def test_the_record_does_not_keep_the_optimizer_alive():
    strategy = ts.MirroredStrategy(num_replicas=2)
    with strategy.scope():
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    ref = weakref.ref(opt)

    del opt
    gc.collect()

    assert ref() is None
