"""Workloads of the conformance matrix (tests/test_conformance.py): ordinary PyTorch 2 training code, run
once as plain torch on the global batch (the reference) and once inside a strategy.

Each workload trains a few steps and returns its final parameters and buffers. The same step code runs
in both places: ``Runner`` hides whether a strategy is present (``run``, the loss divisor, the split of the
global batch), nothing else.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import torch

from tests import _conformance_extra as _extra

B = 12  # global batch: splits evenly over 1, 2 and 3 replicas
STEPS = 3
LR = 0.05

WORKLOADS = (
    "conv_bn",
    "conv_bn_frozen",
    "transformer",
    "deepcopy",
    "grad_accumulation",
    "clip_grad_norm",
    "lr_scheduler",
    "adamw",
    "grad_scaler",
    "autocast",
    "compile",
    "checkpoint",
    *_extra.WORKLOADS,
)
FLOAT32 = {"compile", "autocast"}


class Runner:
    """Plain torch (strategy None) or a strategy: how to build, split, run a step and scale the loss."""

    def __init__(self, strategy: Any = None):
        self.strategy = strategy

    def scope(self) -> Any:
        import contextlib

        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def split(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        if self.strategy is None:
            return tensors
        n = self.strategy.num_replicas_in_sync
        return tuple(
            self.strategy.experimental_distribute_values_from_function(
                lambda c, t=t: t.chunk(n)[c.replica_id_in_sync_group]
            )
            for t in tensors
        )

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.strategy is None:
            return fn(*args)
        return self.strategy.run(fn, args=args)

    def loss(self, per_example: torch.Tensor) -> torch.Tensor:
        import torchstrategies as ts

        if self.strategy is None:
            return per_example.sum() / B
        return ts.compute_average_loss(per_example, global_batch_size=B)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> None:
        """clip_grad_norm_ between backward and step, as on one device: after backward every ``.grad`` is
        the global gradient in every strategy (docs/strategies.md, "The gradient rule")."""
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def _data(step: int, shape: tuple[int, ...], classes: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, *shape, generator=g, dtype=dtype), torch.randint(0, classes, (B,), generator=g)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp_with_copies() -> torch.nn.Module:
    layer = torch.nn.Linear(6, 6)
    return torch.nn.Sequential(
        copy.deepcopy(layer), torch.nn.Tanh(), copy.deepcopy(layer), torch.nn.Linear(6, 3)
    )


def _conv_bn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 3),
    )


class _Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8, padding_idx=0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # deep-copies `layer`
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.enc(self.emb(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(1, 11, (B, 5), generator=g)
    lengths = torch.randint(2, 6, (B,), generator=g)
    tokens[torch.arange(5).unsqueeze(0) >= lengths.unsqueeze(1)] = 0  # padding at the end
    return tokens, torch.randint(0, 3, (B,), generator=g)


def train(workload: str, runner: Runner, order: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Trains ``workload`` under ``runner`` with ``zero_grad`` "before" backward or "after" step."""
    if workload in _extra.WORKLOADS:
        return _extra.train(workload, runner, order)
    dtype = torch.float32 if workload in FLOAT32 else torch.float64
    torch.manual_seed(0)
    with runner.scope():
        if workload in ("conv_bn", "conv_bn_frozen"):
            model = _conv_bn()
        elif workload == "transformer":
            model = _Transformer()
        else:
            model = _mlp_with_copies()
        model = model.to(dtype)
        if workload == "conv_bn_frozen":
            model[1].eval()  # fine-tuning with frozen BatchNorm statistics
        params = list(model.parameters())
        if workload == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.7) if workload == "lr_scheduler" else None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if workload == "grad_scaler" else None
        fwd = torch.compile(model) if workload == "compile" else model

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if workload == "transformer":
            return _tokens(step)
        shape = (2, 5, 5) if workload.startswith("conv_bn") else (6,)
        x, y = _data(step, shape, 3, dtype)
        if workload == "grad_scaler" and step == 1:
            x[B - 1] = float("inf")  # a non-finite gradient on the last replica only: nobody steps
        return x, y

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = fwd(x)
        if workload == "autocast":
            assert out.dtype == torch.bfloat16, "autocast did not reach the replica"
        return runner.loss(torch.nn.functional.cross_entropy(out.float(), y, reduction="none").to(dtype))

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        if order == "before":
            opt.zero_grad()
        loss = loss_of(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if workload == "clip_grad_norm":
                runner.clip(params, 0.05)
            opt.step()
        if sched is not None:
            sched.step()
        if order == "after":
            opt.zero_grad()

    def micro(x: torch.Tensor, y: torch.Tensor, first: bool) -> None:
        if order == "before" and first:
            opt.zero_grad()
        loss_of(x, y).div(3).backward()

    def apply() -> None:
        opt.step()
        if order == "after":
            opt.zero_grad()

    for step in range(steps):
        if workload == "checkpoint" and step == steps // 2 + 1:
            model, opt, fwd, params = _restore(runner, model, opt, dtype)
        if workload == "grad_accumulation":
            for k in range(3):
                x, y = batch(10 * step + k)
                runner.run(micro, *runner.split(x, y), k == 0)
            runner.run(apply)
        elif workload == "autocast":
            x, y = batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                runner.run(step_fn, *runner.split(x, y))
        else:
            x, y = batch(step)
            runner.run(step_fn, *runner.split(x, y))
    out = _state(model)
    if scaler is not None:
        out["scale"] = torch.tensor(scaler.get_scale())
    if sched is not None:
        out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


def _restore(runner: Runner, model: torch.nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype) -> Any:
    """Saves model and optimizer mid-training and continues with fresh objects loaded from the bytes."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    with runner.scope():
        torch.manual_seed(123)  # different initial values: the load must overwrite them
        fresh = _mlp_with_copies().to(dtype)
        new_opt = torch.optim.SGD(list(fresh.parameters()), lr=LR, momentum=0.9)
    fresh.load_state_dict(saved["model"])
    new_opt.load_state_dict(saved["opt"])
    return fresh, new_opt, fresh, list(fresh.parameters())


def tolerance(workload: str) -> dict[str, float]:
    if workload == "autocast":
        return {"rtol": 2e-2, "atol": 2e-2}  # bf16 matmuls of a slice vs the whole batch round differently
    if workload in FLOAT32:
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 1e-9, "atol": 1e-12}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], workload: str) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], msg=lambda m, k=k: f"{workload}: {k}: {m}", **tolerance(workload)
        )
