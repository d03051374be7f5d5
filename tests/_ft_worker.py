"""A worker of the fault-tolerant tests (tests/test_fault_tolerant_mwms.py), run by the fault-tolerant launcher.

Environment: FT_OUT (folder for the result), FT_STEPS, FT_CLIP (clip_grad_norm_'s max_norm in step_fn,
0: none), FT_BATCHNORM, FT_DIVERGE (at this step slot 1 writes a parameter in place before backward),
FT_REDUCE (step_fn returns the global loss, strategy.reduce before backward),
FT_WAIT_FULL (after FT_STEPS, go on until the generation has this many members again), FT_TIMEOUT,
FT_MIN_WORKERS, FT_FAULTS (a JSON list of
{"slot", "restart", "at_least_step", "phase", "action": "kill" | "stop" | "fail", optional "once": a file
name that only the first worker to get there creates}: this incarnation kills or stops itself at the first
phase that matches, or ("fail") raises CollectiveFailed there: at "commit", its step's collectives completed
on every member but count as failed on it alone). Writes <FT_OUT>/<slot>.<pid>.json at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch

import torchstrategies as ts
from torchstrategies.errors import MembershipBelowMinimumError, ReplicaDivergenceError
from torchstrategies.strategies.fault_tolerance.group import CollectiveFailed

GLOBAL_BATCH = 12
SAMPLES = 96


def problem(batchnorm: bool = False) -> tuple[torch.utils.data.TensorDataset, torch.nn.Module]:
    """The data and the initial model (the test's reference builds the same); ``batchnorm``: a BatchNorm1d
    on the input first (FT_BATCHNORM=1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    torch.manual_seed(1234)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    model = torch.nn.Sequential(*([torch.nn.BatchNorm1d(6)] if batchnorm else []), *layers).double()
    return torch.utils.data.TensorDataset(x, y), model


def optimizer_and_scheduler(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def loss_of(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ts.compute_average_loss((model(x) - y).pow(2).squeeze(1), global_batch_size=GLOBAL_BATCH)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, batch: list[torch.Tensor],
               clip: float, reduce: object = None) -> torch.Tensor:
    """The ordinary step code, as on one device (the test's reference runs it on the whole global batch).
    With ``reduce`` (``strategy.reduce``), returns the loss summed over the workers, reduced before backward."""
    loss = loss_of(model, batch)
    total = loss.detach() if reduce is None else reduce("SUM", loss.detach())  # type: ignore[operator]
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad()
    return total


def random_hashes() -> dict[str, str]:
    """sha256 of torch's, Python's and numpy's global random states."""
    return {"rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "py_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
            "np_rng": hashlib.sha256(np.random.get_state()[1].tobytes() + repr(np.random.get_state()[2:]).encode()
                                     ).hexdigest()}


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def main() -> int:
    slot = int(os.environ["TORCHSTRATEGIES_FT_WORKER"])
    restart = int(os.environ.get("TORCHSTRATEGIES_FT_RESTART", "0"))
    steps = int(os.environ["FT_STEPS"])
    faults = [f for f in json.loads(os.environ.get("FT_FAULTS", "[]"))
              if f["slot"] == slot and f["restart"] == restart]
    opts = ts.FaultTolerance(min_workers=int(os.environ.get("FT_MIN_WORKERS", "1")),
                             timeout_seconds=float(os.environ["FT_TIMEOUT"]), heartbeat_seconds=0.05,
                             dead_after_seconds=0.5)
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(opts, os.environ.get("FT_IMPLEMENTATION", "GLOO"))
    with strategy.scope():
        dataset, model = problem(os.environ.get("FT_BATCHNORM") == "1")
        opt, sched = optimizer_and_scheduler(model)
    seed_all(100 + slot + 10 * restart)  # random states of its own: the heal must replace them
    clip = float(os.environ.get("FT_CLIP", "0"))
    loop = strategy.training_loop(model, opt, ts.GlobalBatches(dataset, GLOBAL_BATCH, seed=7), sched)
    applied: list[int] = []
    sizes: list[int] = []  # the generation's size at each applied step

    def count(*_: object) -> None:
        applied.append(loop.steps)
        sizes.append(loop.generation.size if loop.generation is not None else 0)

    opt.register_step_post_hook(count)

    def phase(name: str) -> None:
        for f in faults:
            if f["phase"] == name and loop.steps >= f["at_least_step"]:
                faults.remove(f)
                if "once" in f:  # the first worker to get here takes the fault, the others do not
                    try:
                        os.close(os.open(os.path.join(os.environ["FT_OUT"], f["once"]), os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        return
                if f["action"] == "fail":
                    raise CollectiveFailed(f"injected at {name} of step {loop.steps}")
                os.kill(os.getpid(), signal.SIGKILL if f["action"] == "kill" else signal.SIGSTOP)

    loop.phase_hook = phase

    diverge_at = int(os.environ.get("FT_DIVERGE", "-1"))
    reduce_loss = strategy.reduce if os.environ.get("FT_REDUCE") == "1" else None
    last_loss = float("nan")

    def step_fn(batch: list[torch.Tensor]) -> torch.Tensor:
        torch.rand(()), random.random(), np.random.rand()  # one draw of each generator a step
        if loop.steps == diverge_at and slot == 1:
            with torch.no_grad():
                model[-1].bias.add_(1.0)  # on this worker only: the agreement check must name it
        return train_step(model, opt, sched, batch, clip, reduce_loss)

    error = None
    tasks_after_first = None
    full = int(os.environ.get("FT_WAIT_FULL", "0"))  # also go on until the generation has this many members

    def going_on() -> bool:  # the same answer on every member (same steps, same generation)
        if loop.steps < steps:
            return True
        return loop.steps < 50 * steps and (loop.generation is None or loop.generation.size < full)

    try:
        while going_on():
            last_loss = float(loop.step(step_fn))
            if loop.steps >= steps:
                time.sleep(0.02)  # waiting for a worker to come back: leave it the CPU
            if tasks_after_first is None:
                tasks_after_first = len(os.listdir("/proc/self/task"))
    except (MembershipBelowMinimumError, ReplicaDivergenceError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()
                          if p in opt.state]) if opt.state else torch.zeros(0)
    result = {
        "slot": slot, "pid": os.getpid(), "restart": restart, "steps": loop.steps, "applied": applied, "sizes": sizes,
        "loss": last_loss,
        "buffers": {k: v.tolist() for k, v in model.state_dict().items() if k not in dict(model.named_parameters())},
        "healed_at": loop.healed_at, "refused": loop.refused, "aborted": loop.aborted, "error": error,
        "params": flat.tolist(), "momentum": momentum.tolist(), "lr": [g["lr"] for g in opt.param_groups],
        "sched": sched.state_dict()["last_epoch"],  # type: ignore[attr-defined]
        **random_hashes(),
        "tasks_after_first": tasks_after_first,
    }
    strategy.shutdown()
    result["threads"] = [t.name for t in threading.enumerate()]
    result["tasks_at_end"] = len(os.listdir("/proc/self/task"))
    out = os.environ["FT_OUT"]
    with open(os.path.join(out, f"{slot}.{os.getpid()}.json.tmp"), "w") as fh:
        json.dump(result, fh)
    os.replace(os.path.join(out, f"{slot}.{os.getpid()}.json.tmp"), os.path.join(out, f"{slot}.{os.getpid()}.json"))
    return 3 if error else 0


if __name__ == "__main__":
    sys.exit(main())
