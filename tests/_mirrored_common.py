"""Shared pieces of the in-process strategy tests (MirroredStrategy, CentralStorage, OneDevice): the replica's
id, a float64 model trained the same way with and without a strategy, and replica functions several test
modules use."""

from __future__ import annotations

from collections.abc import Callable

import torch

import torchstrategies as ts

K_STEPS = 3


def replica_id() -> int:
    """The id, in its sync group, of the replica running the caller (inside ``strategy.run``)."""
    return ts.get_replica_context().replica_id_in_sync_group


def average_loss(strategy, per_example: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The loss averaged over the global batch: plain torch (strategy None) divides the sum by it; a replica
    uses ``ts.compute_average_loss``."""
    if strategy is None:
        return per_example.sum() / global_batch
    return ts.compute_average_loss(per_example, global_batch_size=global_batch)


def all_but_one_merge(skipper: int) -> Callable[[], int]:
    """A replica function in which every replica but ``skipper`` makes one merge_call (a mismatch)."""

    def fn() -> int:
        if replica_id() != skipper:
            ts.get_replica_context().merge_call(lambda strategy: None)
        return 0

    return fn


# The parity workload: a float64 MLP trained K_STEPS steps on the same batches, once on one device (the
# reference) and once under a strategy.


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


def batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(global_batch, 5, generator=g, dtype=torch.float64),
            torch.randn(global_batch, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(K_STEPS)
    ]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train(strategy, opt_name: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The final parameters (copies on the CPU) after training on ``data``; strategy None: one device."""
    if strategy is None:
        model = make_model()
        opt = make_optimizer(opt_name, model.parameters())
    else:
        with strategy.scope():
            model = make_model()
            opt = make_optimizer(opt_name, model.parameters())

    def step(x, y):
        opt.zero_grad()
        loss = ts.compute_average_loss((model(x) - y).pow(2).sum(1))
        loss.backward()
        opt.step()
        return loss

    if strategy is None:
        for x, y in data:
            step(x, y)
    else:
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=(x, y))
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]
