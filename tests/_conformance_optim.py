"""More rows of the common-patterns matrix (tests/test_conformance_patterns.py, through
tests/_conformance_patterns.py): what a PyTorch 2 user does with schedulers and optimizers beyond one
``step()`` a batch. Each trains ``STEPS`` steps in float64 under a ``Runner`` and returns its final
parameters, optimizer state and learning rates; the same code runs as plain torch on one device (the
reference).

* ``warm_restarts``: ``CosineAnnealingWarmRestarts`` stepped every batch (a scheduler class with a ``step``
  of its own: it was advanced once per replica, silently).
* ``sequential_lr``: ``SequentialLR`` of a ``LinearLR`` warm-up and an ``ExponentialLR`` (a ``step`` of its own
  that steps its children: a merge_call mismatch before).
* ``lbfgs_closure``: ``torch.optim.LBFGS`` with ``step(closure)``: under MultiWorkerMirrored equal to one device
  (the closure's loss summed over the ranks; before, each rank's line search ran on its own share and the
  ranks drifted apart, silently); in-process a named error (the replicas share one optimizer).
* ``add_param_group``: a second head joins the optimizer with its own lr after two steps.
* ``optimizer_reload``: Adam's ``load_state_dict`` of a state saved two steps earlier, mid-training.
* ``optimizer_in_backward``: one SGD per parameter, stepped in ``register_post_accumulate_grad_hook`` (the
  PyTorch tutorial's memory saver; named error: the hook sees the replica's share. It failed with "modified
  by an inplace operation" before).
* ``post_accumulate_clamp``: ``p.grad.clamp_`` in a post-accumulate-grad hook (named error; silently wrong
  before, and MultiWorkerMirrored's ranks ended with different optimizer state).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B = 12
STEPS = 4
F64 = torch.float64

WORKLOADS = ("warm_restarts", "sequential_lr", "lbfgs_closure", "add_param_group", "optimizer_reload",
             "optimizer_in_backward", "post_accumulate_clamp")
_POST = (RuntimeError, "runs when this replica's share of the gradient (the gradient of its rows) has accumulated")
ERRORS = {"lbfgs_closure": (ValueError, "optimizer.step(closure) is not supported inside run of a strategy with"),
          "optimizer_in_backward": _POST, "post_accumulate_clamp": _POST}


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9000 + step)
    return torch.randn(B, 6, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def _state(opt: torch.optim.Optimizer, **modules: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, the optimizer's tensor state and every group's lr."""
    out = {f"{n}.{k}": v.detach().clone() for n, m in modules.items() for k, v in m.state_dict().items()}
    sd = opt.state_dict()
    for index, state in sd["state"].items():
        out.update({f"opt.{index}.{k}": v.detach().clone().to(F64) for k, v in state.items() if torch.is_tensor(v)})
    out.update({f"opt.group{i}.lr": torch.tensor(float(g["lr"]), dtype=F64) for i, g in enumerate(sd["param_groups"])})
    return out


def train(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "warm_restarts": _scheduled, "sequential_lr": _scheduled, "lbfgs_closure": _lbfgs,
        "add_param_group": _add_param_group, "optimizer_reload": _optimizer_reload,
        "optimizer_in_backward": _post_accumulate, "post_accumulate_clamp": _post_accumulate,
    }[workload](workload, runner)


def _loop(runner: Any, step_fn: Any, between: Any = None) -> None:
    for step in range(STEPS):
        if between is not None:
            between(step)  # outside ``run``, as code between two batches
        runner.run(step_fn, *runner.split(*_data(step)), step)


def _scheduled(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    lr = torch.optim.lr_scheduler
    with runner.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if workload == "warm_restarts":
            sched: lr.LRScheduler = lr.CosineAnnealingWarmRestarts(opt, T_0=2, eta_min=0.01)
        else:
            sched = lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=2),
                                          lr.ExponentialLR(opt, 0.8)], milestones=[2])

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        opt.zero_grad()
        runner.loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        opt.step()
        sched.step()  # every batch, in the step

    _loop(runner, step_fn)
    return _state(opt, model=model)


def _lbfgs(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4,
                                line_search_fn="strong_wolfe")

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = runner.loss(F.cross_entropy(model(x), y, reduction="none"))
            loss.backward()
            return loss

        opt.step(closure)

    _loop(runner, step_fn)
    return _state(opt, model=model)


def _add_param_group(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    with runner.scope():
        model, extra = _mlp(), nn.Linear(6, 3).to(F64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def between(step: int) -> None:
        if step == 2:
            opt.add_param_group({"params": list(extra.parameters()), "lr": 0.05})

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        opt.zero_grad()
        out = model(x) + (extra(x) if step >= 2 else 0)
        runner.loss(F.cross_entropy(out, y, reduction="none")).backward()
        opt.step()

    _loop(runner, step_fn, between)
    return _state(opt, model=model, extra=extra)


def _optimizer_reload(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.05, amsgrad=True)
    saved = io.BytesIO()

    def between(step: int) -> None:
        if step == 1:
            torch.save(opt.state_dict(), saved)
        if step == 3:
            saved.seek(0)
            opt.load_state_dict(torch.load(saved, weights_only=True))  # back to the state of step 1

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        opt.zero_grad()
        runner.loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        opt.step()

    _loop(runner, step_fn, between)
    return _state(opt, model=model)


def _post_accumulate(workload: str, runner: Any) -> dict[str, torch.Tensor]:
    with runner.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        per_param = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad()

    def clamp(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.clamp_(-0.01, 0.01)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward if workload == "optimizer_in_backward" else clamp)

    def step_fn(x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        if workload == "post_accumulate_clamp":
            opt.zero_grad()
        runner.loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        if workload == "post_accumulate_clamp":
            opt.step()

    _loop(runner, step_fn)
    return _state(opt, model=model)
