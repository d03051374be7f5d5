"""A worker of the fault-tolerant tests (tests/test_fault_tolerant_mwms.py), run by the fault-tolerant launcher.

Environment: FT_OUT (folder for the result), FT_STEPS, FT_WAIT_FULL (after FT_STEPS, go on until the
generation has this many members again), FT_TIMEOUT, FT_MIN_WORKERS, FT_FAULTS (a JSON list of
{"slot", "restart", "at_least_step", "phase", "action": "kill" | "stop", optional "once": a file name that
only the first worker to get there creates}: this incarnation kills or stops itself at the first phase
that matches). Writes <FT_OUT>/<slot>.<pid>.json at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time

import torch

import torchstrategies as ts
from torchstrategies.errors import MembershipBelowMinimumError

GLOBAL_BATCH = 12
SAMPLES = 96


def problem() -> tuple[torch.utils.data.TensorDataset, torch.nn.Module]:
    """The data and the initial model (the test's reference builds the same)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True))
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    return torch.utils.data.TensorDataset(x, y), model


def optimizer_and_scheduler(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def loss_of(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ts.compute_average_loss((model(x) - y).pow(2).squeeze(1), global_batch_size=GLOBAL_BATCH)


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
        dataset, model = problem()
        opt, sched = optimizer_and_scheduler(model)
    torch.manual_seed(100 + slot + 10 * restart)  # a random state of its own: the heal must replace it
    loop = strategy.training_loop(model, opt, ts.GlobalBatches(dataset, GLOBAL_BATCH, seed=7), sched)
    applied: list[int] = []
    opt.register_step_post_hook(lambda *_: applied.append(loop.steps))

    def phase(name: str) -> None:
        for f in faults:
            if f["phase"] == name and loop.steps >= f["at_least_step"]:
                faults.remove(f)
                if "once" in f:  # the first worker to get here takes the fault, the others do not
                    try:
                        os.close(os.open(os.path.join(os.environ["FT_OUT"], f["once"]), os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        return
                os.kill(os.getpid(), signal.SIGKILL if f["action"] == "kill" else signal.SIGSTOP)

    loop.phase_hook = phase
    error = None
    tasks_after_first = None
    full = int(os.environ.get("FT_WAIT_FULL", "0"))  # also go on until the generation has this many members

    def going_on() -> bool:  # the same answer on every member (same steps, same generation)
        if loop.steps < steps:
            return True
        return loop.steps < 50 * steps and (loop.generation is None or loop.generation.size < full)

    try:
        while going_on():
            loop.step(lambda batch: (torch.rand(()), loss_of(model, batch))[1])  # one random draw a step
            if loop.steps >= steps:
                time.sleep(0.02)  # waiting for a worker to come back: leave it the CPU
            if tasks_after_first is None:
                tasks_after_first = len(os.listdir("/proc/self/task"))
    except MembershipBelowMinimumError as exc:
        error = f"{type(exc).__name__}: {exc}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()
                          if p in opt.state]) if opt.state else torch.zeros(0)
    result = {
        "slot": slot, "pid": os.getpid(), "restart": restart, "steps": loop.steps, "applied": applied,
        "healed_at": loop.healed_at, "refused": loop.refused, "aborted": loop.aborted, "error": error,
        "params": flat.tolist(), "momentum": momentum.tolist(), "lr": [g["lr"] for g in opt.param_groups],
        "sched": sched.state_dict()["last_epoch"],  # type: ignore[attr-defined]
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
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
