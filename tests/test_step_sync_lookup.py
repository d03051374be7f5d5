"""MultiWorkerMirroredStrategy's per-optimizer lookup (strategies/_step_sync.py, issue 50): which gradient
synchronizers watch an optimizer's parameters is remembered by the strategy's ``Synchronizers``, keyed weakly
by the optimizer, never written on the user's object, and redone when the synchronizers or the parameters
change."""

from __future__ import annotations

import gc
import weakref

import torch

from torchstrategies.strategies._step_sync import Synchronizers


class _Watching:
    """What ``for_optimizer`` asks of a synchronizer: is it alive, does it watch ``p``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.alive = True
        self._ids = {id(p) for p in params}

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self._ids


def test_the_lookup_is_held_by_the_strategy_and_nothing_is_written_on_the_optimizer():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    before = dict(vars(opt))
    watch_a = _Watching(list(a.parameters()))
    syncs = Synchronizers(make=None)  # type: ignore[arg-type]  # (not called: nothing to reduce here)
    syncs.add(watch_a)  # type: ignore[arg-type]

    found, owners = syncs.for_optimizer(opt)

    assert vars(opt).keys() == before.keys()  # main wrote _torchstrategies_mwms_syncs here
    assert found == [watch_a]
    assert [(p, o) for p, o in owners] == [(p, watch_a) for p in a.parameters()] + [(p, None) for p in b.parameters()]
    assert syncs.for_optimizer(opt)[1] is owners  # remembered while nothing changed


def test_the_lookup_is_redone_when_a_synchronizer_or_a_parameter_is_added():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    syncs = Synchronizers(make=None)  # type: ignore[arg-type]
    syncs.add(_Watching(list(a.parameters())))  # type: ignore[arg-type]
    first = syncs.for_optimizer(opt)[1]

    watch_b = _Watching(list(b.parameters()))
    syncs.add(watch_b)  # type: ignore[arg-type]
    opt.add_param_group({"params": list(b.parameters())})
    found, owners = syncs.for_optimizer(opt)

    assert owners is not first and watch_b in found
    assert [o for p, o in owners if any(p is q for q in b.parameters())] == [watch_b, watch_b]


def test_the_lookup_does_not_keep_the_optimizer_alive():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    syncs = Synchronizers(make=None)  # type: ignore[arg-type]
    syncs.add(_Watching(list(model.parameters())))  # type: ignore[arg-type]
    syncs.for_optimizer(opt)
    ref = weakref.ref(opt)

    del opt
    gc.collect()

    assert ref() is None  # (a strong map by optimizer would keep it, and its parameters, alive)
