"""What torch code does to modules keeps replicated training exact under MirroredStrategy(2) and
CentralStorage: each case trains 2 steps (zero_grad before backward) and equals plain torch (float64)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from torch.nn.utils import parametrize

import torchstrategies as ts

B = 8


class _Symmetric(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


def _net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _case(name: str, in_scope: Any) -> tuple[torch.nn.Module, Any]:
    """Builds the model (inside ``in_scope``) and transforms it; returns (model, forward function)."""
    with in_scope:
        model = _net().double()
        if name == "deepcopy_in_scope":
            model = torch.nn.Sequential(copy.deepcopy(model[0]), torch.nn.Tanh(), copy.deepcopy(model[2]))
        if name == "parametrize_in_scope":
            parametrize.register_parametrization(model[0], "weight", _Symmetric())
        if name == "weight_norm_in_scope":
            torch.nn.utils.parametrizations.weight_norm(model[2])
        if name == "tied":
            model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
            model.add_module("extra", torch.nn.Linear(4, 4).double())
            model.extra.weight = model[0].weight
    if name == "deepcopy_outside_scope":
        model = copy.deepcopy(model)
    if name == "copy_copy":
        model = copy.copy(model)
    if name == "to_double_after_scope":
        model = model.float().to(torch.float64)
    if name == "parametrize_after_scope":
        parametrize.register_parametrization(model[0], "weight", _Symmetric())
    if name == "state_dict_round_trip":
        torch.manual_seed(5)
        other = _net().double()
        model.load_state_dict(other.state_dict())
    if name == "hooks":
        model[0].register_forward_hook(lambda m, i, o: o * 1.5)
        model[2].weight.register_hook(ts.linear_gradient_hook(lambda g: g * 2.0))  # (linear: declared)
    if name == "functional_call":
        return model, lambda x: torch.func.functional_call(model, dict(model.named_parameters()), (x,))
    if name == "tied":
        return model, lambda x: model[2](torch.tanh(model.extra(model[0](x))))
    return model, model


CASES = [
    "deepcopy_in_scope",
    "deepcopy_outside_scope",
    "copy_copy",
    "to_double_after_scope",
    "state_dict_round_trip",
    "parametrize_in_scope",
    "parametrize_after_scope",
    "weight_norm_in_scope",
    "tied",
    "hooks",
    "functional_call",
]


def _train(name: str, strategy: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, fwd = _case(name, strategy.scope() if strategy is not None else contextlib.nullcontext())
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        per_example = (fwd(x) - y).pow(2).sum(1)
        if strategy is None:
            loss = per_example.sum() / B
        else:
            loss = ts.compute_average_loss(per_example, global_batch_size=B)
        loss.backward()
        opt.step()

    for i in range(2):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(B, 4, generator=g, dtype=torch.float64)
        y = torch.randn(B, 2, generator=g, dtype=torch.float64)
        if strategy is None:
            step(x, y)
        else:
            xs, ys = (
                strategy.experimental_distribute_values_from_function(
                    lambda c, t=t: t.chunk(c.num_replicas_in_sync)[c.replica_id_in_sync_group]
                )
                for t in (x, y)
            )
            strategy.run(step, args=(xs, ys))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["mirrored2", "central_storage"])
@pytest.mark.parametrize("name", CASES)
def test_torch_module_operation_keeps_training_equal_to_one_device(name, strategy):
    s = ts.MirroredStrategy(num_replicas=2) if strategy == "mirrored2" else ts.CentralStorageStrategy(
        ["cpu:0", "cpu:1"]
    )
    got, ref = _train(name, s), _train(name, None)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
