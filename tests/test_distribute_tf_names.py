"""The TF names a TF user reaches for (issue 39, item 4): ``extended.colocate_vars_with``,
``extended.value_container``, ``extended.update`` handing ``fn`` a variable under every strategy, and
``torch.as_tensor`` on a ``ts.Variable``."""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts

_STRATEGIES = {
    "OneDeviceStrategy": lambda: ts.OneDeviceStrategy("cpu"),
    "MirroredStrategy": lambda: ts.MirroredStrategy(num_replicas=2),
    "CentralStorageStrategy": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


@pytest.fixture(params=sorted(_STRATEGIES))
def strategy(request):
    return _STRATEGIES[request.param]()


def test_update_hands_fn_a_variable_it_can_assign_under_every_strategy(strategy):
    with strategy.scope():
        v = ts.Variable(1.0)
    seen = []

    def fn(var, delta):
        seen.append(var)
        return var.assign_add(delta)

    strategy.extended.update(v, fn, args=(2.0,))
    assert seen and all(isinstance(x, ts.Variable) for x in seen)
    assert [float(c) for c in strategy.experimental_local_results(v)] == [3.0] * len(seen)


def test_value_container_maps_what_update_handed_fn_back_to_the_variable(strategy):
    with strategy.scope():
        v = ts.Variable(torch.zeros(2))
    parts = []
    strategy.extended.update(v, lambda var: parts.append(var))
    for part in parts:
        container = strategy.extended.value_container(part)
        assert container is v
    for component in strategy.experimental_local_results(v):  # TF: value in local_results(container)
        container = strategy.extended.value_container(component)
        assert any(c is component for c in strategy.experimental_local_results(container))
    plain = torch.ones(1)
    assert strategy.extended.value_container(plain) is plain
    assert strategy.extended.value_container(v) is v


def test_colocate_vars_with_takes_a_variable_of_the_scope(strategy):
    with strategy.scope():
        v = ts.Variable(1.0)
        with strategy.extended.colocate_vars_with(v):
            w = ts.Variable(2.0)
        assert strategy.extended.variable_created_in_scope(w)
        assert [c.device for c in strategy.experimental_local_results(w)] == \
            [c.device for c in strategy.experimental_local_results(v)]
        with pytest.raises(ValueError, match="colocate_vars_with` must only be passed a variable created"):
            with strategy.extended.colocate_vars_with(torch.zeros(1)):
                pass
    with pytest.raises(RuntimeError, match="scope"):
        with strategy.extended.colocate_vars_with(v):
            pass


@pytest.mark.parametrize("value", [1.0, [1.0, 2.0], [[1.0], [2.0]]])
def test_torch_as_tensor_and_torch_tensor_read_a_variable(value):
    v = ts.Variable(value)
    expected = torch.tensor(value)
    assert torch.equal(torch.as_tensor(v), expected)
    assert torch.equal(torch.tensor(v), expected)
    assert torch.as_tensor(v, dtype=torch.float64).dtype == torch.float64
    t = torch.as_tensor(v)
    t.add_(1)  # a read of the value, as TF's convert_to_tensor: the variable is not written
    assert torch.equal(v.read_value(), expected)
