"""Workloads of issue 46's common patterns for the conformance matrix (tests/test_conformance_patterns.py):
ordinary training code, run once as plain torch on the global batch (the reference) and once under a
strategy; each either equals the reference (float64, 1e-9) or raises the named error of ``ERRORS``.

* ``plateau_global``: ``ReduceLROnPlateau.step`` with the global loss (all-reduced inside ``run``), every step.
* ``plateau_local``: ``ReduceLROnPlateau.step`` with each replica's own part of the loss (named error).
* ``stateful_gru``: a GRU that keeps its hidden state on the module across steps (``self.hidden``).
* ``clamp_hook``: a non-linear gradient hook, ``p.register_hook(lambda g: g.clamp(-c, c))`` (named error).
* ``linear_hook``: a gradient hook declared linear with ``ts.linear_gradient_hook`` (a scale and a mask).
* ``scale_grad_by_freq``: ``nn.Embedding(scale_grad_by_freq=True)`` (named error).
* ``several_models``: two models trained one after the other in one process (k-fold), the first kept alive
  by a reference cycle until the garbage collector runs (``Runner.collect_garbage``: on some ranks only).
* ``frozen_on_one_replica``: the replica (rank) 1 alone calls ``requires_grad_(False)`` on a parameter
  (named error under MultiWorkerMirrored).
* tests/_conformance_optim.py's: schedulers with a ``step`` of their own, ``step(closure)`` (LBFGS),
  ``add_param_group`` and an optimizer's ``load_state_dict`` mid-training.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import _conformance_optim as _optim

B = 12  # splits evenly over 1, 2 and 3 replicas
LR = 0.05
STEPS = 4
F64 = torch.float64

WORKLOADS = ("plateau_global", "plateau_local", "stateful_gru", "clamp_hook", "linear_hook",
             "scale_grad_by_freq", "several_models", "frozen_on_one_replica", *_optim.WORKLOADS)
# workload -> (error type, text it contains) under a strategy with several replicas; MultiWorkerMirrored's own
# in MW_ERRORS where it differs.
ERRORS = {
    "plateau_local": (ValueError, "ReduceLROnPlateau.step(metric) got different metrics"),
    "clamp_hook": (RuntimeError, "runs on each replica's share of the gradient"),
    "scale_grad_by_freq": (RuntimeError, "scale_grad_by_freq=True"),
    **_optim.ERRORS,
}
MW_ERRORS = {
    **{k: v for k, v in ERRORS.items() if k != "lbfgs_closure"},   # MWMS sums the closure's loss: one device's
    "frozen_on_one_replica": (ValueError, "on rank 1, since the last gradient all-reduce, parameter "
                                          "Sequential.0.weight was frozen"),
}


class Runner:
    """Plain torch (strategy None) or a strategy (tests/_conformance.py's, plus what these workloads need)."""

    def __init__(self, strategy: Any = None, collect: bool = True):
        self.strategy = strategy
        self.collect = collect  # whether collect_garbage runs the collector (a rank that does not: False)

    def scope(self) -> Any:
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def split(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        if self.strategy is None:
            return tensors
        n = self.strategy.num_replicas_in_sync
        return tuple(self.strategy.experimental_distribute_values_from_function(
            lambda c, t=t: t.chunk(n)[c.replica_id_in_sync_group]) for t in tensors)

    def run(self, fn: Any, *args: Any) -> Any:
        return fn(*args) if self.strategy is None else self.strategy.run(fn, args=args)

    def loss(self, per_example: torch.Tensor) -> torch.Tensor:
        import torchstrategies as ts

        if self.strategy is None:
            return per_example.sum() / B
        return ts.compute_average_loss(per_example, global_batch_size=B)

    def global_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Inside a step: the sum of ``t`` over the replicas (one device: ``t``)."""
        import torchstrategies as ts

        if self.strategy is None:
            return t
        return ts.get_replica_context().all_reduce("sum", t)

    def replica_id(self) -> int:
        import torchstrategies as ts

        rc = ts.get_replica_context()
        return 0 if rc is None else rc.replica_id_in_sync_group

    def collect_garbage(self) -> None:
        if self.collect:
            gc.collect()


def _data(step: int, features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    return torch.randn(B, features, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _state(**modules: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.detach().clone() for name, m in modules.items() for k, v in m.state_dict().items()}


def train(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    if workload in _optim.WORKLOADS:
        return _optim.train(workload, runner)
    torch.manual_seed(0)
    return {
        "plateau_global": _plateau, "plateau_local": _plateau, "stateful_gru": _stateful_gru,
        "clamp_hook": _hook, "linear_hook": _hook, "scale_grad_by_freq": _scale_grad_by_freq,
        "several_models": _several_models, "frozen_on_one_replica": _frozen_on_one_replica,
    }[workload](workload, runner)


def _fit(runner: Runner, model: nn.Module, opt: torch.optim.Optimizer, after: Any = None,
         batch: Any = _data, forward: Any = None) -> None:
    """``STEPS`` steps of cross-entropy training; ``after(loss, step)`` runs in the step after ``opt.step()``."""
    fwd = forward or model

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        opt.zero_grad()
        loss = runner.loss(F.cross_entropy(fwd(x), y, reduction="none"))
        loss.backward()
        opt.step()
        if after is not None:
            after(loss, step)

    for step in range(STEPS):
        runner.run(step_fn, *runner.split(*batch(step)), step)


def _plateau(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=2.0)  # so large that the loss does not improve enough
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.2)

    def after(loss: torch.Tensor, step: int) -> None:
        sched.step(runner.global_sum(loss.detach()) if workload == "plateau_global" else loss.detach())

    _fit(runner, model, opt, after)
    return {**_state(model=model), "lr": torch.tensor(opt.param_groups[0]["lr"], dtype=F64)}


class _StatefulGRU(nn.Module):
    """Carries its hidden state from one batch to the next, on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.gru(x, self.hidden)
        self.hidden = h.detach()
        return self.head(out[:, -1])


def _sequences(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randn(B, 4, 6, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


def _stateful_gru(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _StatefulGRU().to(F64)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    _fit(runner, model, opt, batch=_sequences)
    return _state(model=model)


def _hook(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    import torchstrategies as ts

    with runner.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if workload == "clamp_hook":
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    else:
        mask = (torch.arange(model[0].weight.numel()) % 3 != 0).reshape(model[0].weight.shape).to(F64)
        model[0].weight.register_hook(ts.linear_gradient_hook(lambda g: g * mask))
        model[2].bias.register_hook(ts.linear_gradient_hook(lambda g: g * 0.5))
    _fit(runner, model, opt)
    return _state(model=model)


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, scale_grad_by_freq=True)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8000 + step)
    return torch.randint(0, 10, (B, 5), generator=g), torch.randint(0, 3, (B,), generator=g)


def _scale_grad_by_freq(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _Bag().to(F64)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    _fit(runner, model, opt, batch=_tokens)
    return _state(model=model)


def _several_models(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    import torchstrategies as ts

    out = {}
    model: nn.Module | None = None
    for fold in range(2):
        with runner.scope():  # (buffers: SyncBatchNorm's running statistics; plain BatchNorm without a strategy)
            model = nn.Sequential(nn.Linear(6, 8), ts.nn.SyncBatchNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
            model.cycle = [model]  # type: ignore[assignment]  # freed only by the garbage collector
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        _fit(runner, model, opt)
        out.update({f"fold{fold}.{k}": v for k, v in _state(model=model).items()})
        del model, opt
        runner.collect_garbage()
    return out


def _frozen_on_one_replica(workload: str, runner: Runner) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)

    def after(loss: torch.Tensor, step: int) -> None:
        if step == 1 and runner.replica_id() == 1:
            model[0].weight.requires_grad_(False)

    _fit(runner, model, opt, after)
    return _state(model=model)
