"""Workloads of issue 35's gradient rule (tests/test_gradient_rule.py): ordinary PyTorch code that reads or
makes gradients outside the usual ``backward(); step()`` path, run as plain torch on the global batch and
inside a strategy (``tests/_conformance.Runner``), float64.

Each returns its final state (parameters and buffers by name).
"""

from __future__ import annotations

from typing import Any

import torch

import torchstrategies as ts
from tests._conformance import B, Runner

LR = 0.1
STEPS = 3
PARITY = ("clip", "manual_update", "assigned", "unfreeze", "outside_model", "running_buffer", "sparse",
          "double_after_scope", "accumulate_then_clip", "reentrant_checkpoint")


def _data(step: int, features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(B, features, generator=g, dtype=torch.float64), torch.randn(B, 2, generator=g,
                                                                                    dtype=torch.float64)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()


class _RunningBaseline(torch.nn.Module):
    """A REINFORCE-style running baseline: a floating buffer written in forward and used in the loss, declared
    MEAN (the replicas' copies are averaged, as one device's running average of the global batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 2)).double()
        self.register_buffer("baseline", torch.zeros(2, dtype=torch.float64))
        ts.declare_buffer_aggregation(self, "baseline", "mean")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x) - (y - self.baseline)
        with torch.no_grad():
            self.baseline.mul_(0.5).add_(y.mean(0), alpha=0.5)
        return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().double() for k, v in model.state_dict().items()}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def train(workload: str, runner: Runner) -> dict[str, torch.Tensor]:  # noqa: C901 - one branch per workload
    torch.manual_seed(0)
    if workload == "outside_model":
        torch.manual_seed(_rank())  # made outside the scope: ranks start apart, the strategy must sync them
        model: Any = _mlp()
        with runner.scope():
            opt: Any = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    else:
        with runner.scope():
            if workload == "running_buffer":
                model = _RunningBaseline()
            elif workload == "sparse":
                model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 3, sparse=True).double(),
                                             "head": torch.nn.Linear(3, 2).double()})
            elif workload == "double_after_scope":
                model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
            else:
                model = _mlp()
            if workload == "unfreeze":
                model[0].requires_grad_(False)  # frozen when the scope exits, unfrozen after step 0
        if workload == "double_after_scope":
            model.double()  # dtype changed after the scope
        with runner.scope():
            if workload == "sparse":
                opt = [torch.optim.SparseAdam(list(model["emb"].parameters()), lr=LR),
                       torch.optim.SGD(model["head"].parameters(), lr=LR)]
            else:
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    opts = opt if isinstance(opt, list) else [opt]

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if workload == "reentrant_checkpoint":  # its backward calls torch.autograd.backward inside backward
            from torch.utils.checkpoint import checkpoint

            h = model[0](x * 0.5) + checkpoint(model[0], x.requires_grad_(), use_reentrant=True)
            return runner.loss((model[2](model[1](h)) - y).pow(2).sum(1))  # model[0]: inside and outside
        if workload == "running_buffer":
            return runner.loss(model(x, y).pow(2).sum(1))
        if workload == "sparse":
            idx = (x.abs() * 3).long().clamp(max=9)[:, :2]
            return runner.loss((model["head"](model["emb"](idx).sum(1)) - y).pow(2).sum(1))
        return runner.loss((model(x) - y).pow(2).sum(1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for o in opts:
            o.zero_grad()
        loss = loss_of(x, y)
        if workload == "assigned":  # DP-SGD style: gradients made by hand and assigned
            params = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params)
            for p, g in zip(params, grads):
                p.grad = g * 1.0
        elif workload == "accumulate_then_clip":
            loss.backward(retain_graph=True)
            loss.mul(0.5).backward()  # a second backward adds to the global gradient once
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            loss.backward()
        if workload == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # on the global gradient
        if workload == "manual_update":
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(LR * p.grad)
            return
        for o in opts:
            o.step()

    for s in range(STEPS):
        if workload == "unfreeze" and s == 1:
            model[0].requires_grad_(True)
        x, y = _data(s)
        runner.run(step, *runner.split(x, y))
    return _state(model)
