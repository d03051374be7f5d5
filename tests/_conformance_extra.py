"""More workloads of the conformance matrix (tests/test_conformance.py): training code whose correctness
under in-process replicas depends on each replica owning its own tensors and on gradients that exist for
some parameters only. Each trains ``STEPS`` steps under a ``Runner`` (tests/_conformance.py) and returns
its final state; the same code runs as plain torch on one device (the reference).

* ``unused_branch_sgd`` / ``unused_branch_adam``: a head that only the first step uses; afterwards it has
  no gradient and must not move (SGD with momentum, Adam).
* ``ema_teacher``: a mean teacher (a deep copy of the student made in the scope) updated by EMA in the
  step after ``optimizer.step()``, whose output enters the loss.
* ``averaged_model``: ``torch.optim.swa_utils.AveragedModel.update_parameters`` in the step.
* ``gan``: a generator and a discriminator, two optimizers, two backward passes per step (the
  generator's backward leaves gradients in the discriminator, as on one device).
* ``grad_checkpointing``: ``torch.utils.checkpoint`` (non-reentrant) around a block.
* ``lstm_packed``: an LSTM over packed variable-length sequences.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B = 12
LR = 0.05
STEPS = 4
WORKLOADS = (
    "unused_branch_sgd",
    "unused_branch_adam",
    "ema_teacher",
    "averaged_model",
    "gan",
    "grad_checkpointing",
    "lstm_packed",
)
F64 = torch.float64


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(B, 6, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


def _state(**modules: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.detach().clone() for name, m in modules.items() for k, v in m.state_dict().items()}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def train(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "unused_branch_sgd": _unused_branch,
        "unused_branch_adam": _unused_branch,
        "ema_teacher": _ema_teacher,
        "averaged_model": _averaged_model,
        "gan": _gan,
        "grad_checkpointing": _grad_checkpointing,
        "lstm_packed": _lstm_packed,
    }[workload](workload, runner, order)


def _loop(runner: Any, step_fn: Any, batch: Any) -> None:
    for step in range(STEPS):
        runner.run(step_fn, *runner.split(*batch(step)), step)


def _train_step(opt: torch.optim.Optimizer, order: str, loss: Any, after_step: Any = None) -> None:
    """zero_grad ("before" backward or "after" the step), ``loss().backward()``, the step, ``after_step()``."""
    if order == "before":
        opt.zero_grad()
    loss().backward()
    opt.step()
    if after_step is not None:
        after_step()
    if order == "after":
        opt.zero_grad()


def _unused_branch(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        a, b = _mlp(), _mlp()
        params = [*a.parameters(), *b.parameters()]
        if workload.endswith("adam"):
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=LR)
        else:
            opt = torch.optim.SGD(params, lr=LR, momentum=0.9)

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        def loss() -> torch.Tensor:
            out = a(x) + (b(x) if step == 0 else 0)  # b only in the first step
            return runner.loss(F.cross_entropy(out, y, reduction="none"))

        _train_step(opt, order, loss)

    _loop(runner, step_fn, _data)
    return _state(a=a, b=b)


def _ema_teacher(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        student = _mlp()
        teacher = copy.deepcopy(student)
        opt = torch.optim.SGD(student.parameters(), lr=LR, momentum=0.9)
    for p in teacher.parameters():
        p.requires_grad_(False)

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        def loss() -> torch.Tensor:
            out = student(x)
            with torch.no_grad():
                target = teacher(x).softmax(1)
            return runner.loss(F.cross_entropy(out, y, reduction="none") + (out.softmax(1) - target).pow(2).sum(1))

        @torch.no_grad()
        def follow() -> None:  # the mean teacher follows the student, once per step
            for tp, sp in zip(teacher.parameters(), student.parameters()):
                tp.mul_(0.9).add_(sp, alpha=0.1)

        _train_step(opt, order, loss, follow)

    _loop(runner, step_fn, _data)
    return _state(student=student, teacher=teacher)


def _averaged_model(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        swa = torch.optim.swa_utils.AveragedModel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        _train_step(opt, order, lambda: runner.loss(F.cross_entropy(model(x), y, reduction="none")),
                    lambda: swa.update_parameters(model))

    _loop(runner, step_fn, _data)
    return _state(model=model, swa=swa)


def _gan(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).to(F64)
        disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)
        opt_g = torch.optim.Adam(gen.parameters(), lr=LR)
        opt_d = torch.optim.SGD(disc.parameters(), lr=LR, momentum=0.5)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(4000 + step)
        return torch.randn(B, 6, generator=g, dtype=F64) + 1.0, torch.randn(B, 4, generator=g, dtype=F64)

    def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
        per_example = F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target), reduction="none")
        return runner.loss(per_example.sum(1))

    def step_fn(real: torch.Tensor, z: torch.Tensor, step: int) -> None:
        _train_step(opt_d, order, lambda: bce(disc(real), 1.0) + bce(disc(gen(z).detach()), 0.0))
        _train_step(opt_g, order, lambda: bce(disc(gen(z)), 1.0))  # (also leaves gradients in disc)

    _loop(runner, step_fn, batch)
    return _state(gen=gen, disc=disc)


def _grad_checkpointing(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        block = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        head = nn.Linear(8, 3)
        model = nn.ModuleDict({"block": block, "head": head}).to(F64)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        def loss() -> torch.Tensor:
            h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return runner.loss(F.cross_entropy(head(h), y, reduction="none"))

        _train_step(opt, order, loss)

    _loop(runner, step_fn, _data)
    return _state(model=model)


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


def _lstm_packed(workload: str, runner: Any, order: str) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _Tagger().to(F64)
        opt = torch.optim.Adam(model.parameters(), lr=LR)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5000 + step)
        lengths = torch.randint(1, 6, (B,), generator=g)
        x = torch.randn(B, 5, 3, generator=g, dtype=F64)
        x[torch.arange(5).unsqueeze(0) >= lengths.unsqueeze(1)] = 0.0
        return x, lengths, torch.randint(0, 2, (B,), generator=g)

    def step_fn(x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor, step: int) -> None:
        _train_step(opt, order, lambda: runner.loss(F.cross_entropy(model(x, lengths), y, reduction="none")))

    _loop(runner, step_fn, batch)
    return _state(model=model)
