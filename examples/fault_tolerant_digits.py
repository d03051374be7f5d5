"""Train on scikit-learn's digits with the fault-tolerant MultiWorkerMirrored mode, and kill a worker.

    python -m torchstrategies.strategies.fault_tolerance.launch --nproc 3 --max-restarts 2 \\
        examples/fault_tolerant_digits.py --fast --kill-at 30

The launcher hosts the job's store and restarts a worker that dies, alone. With ``--kill-at K`` worker
slot 1 kills itself (SIGKILL) in the middle of step K: the other two discard that step, form a new
generation and redo it with the same global batch split between them; the restarted worker copies the
live state from one of them and joins at a step boundary. The step is the ordinary step code (backward,
clipping, the optimizer and scheduler steps, zero_grad) in ``step_fn``. Training computes what the uninterrupted job
computes (up to float rounding). The worker that is member 0 of the last generation prints, as its last
stdout line, ``RESULT {"strategy": "FaultTolerantMultiWorkerMirroredStrategy", "accuracy": ...,
"steps": ..., "aborted": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

try:
    import torchstrategies as ts
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torchstrategies as ts

from mirrored_digits import load  # noqa: E402  (same directory: the same split of the digits)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--fast", action="store_true", help="a few seconds: fewer epochs")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size (all workers together)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--kill-at", type=int, default=None, help="worker slot 1 kills itself at this step (once)")
    p.add_argument("--step-seconds", type=float, default=0.03,
                   help="a pause per step, so that a restarted worker is back before the job ends")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    epochs = min(args.epochs, 8) if args.fast else args.epochs

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    strategy = ts.FaultTolerantMultiWorkerMirroredStrategy(ts.FaultTolerance(min_workers=1, timeout_seconds=10))
    train_set, test_set = load(args.seed)
    with strategy.scope():  # member 0's initial state is copied to every worker when the job starts
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    data = ts.GlobalBatches(train_set, global_batch_size=args.batch_size, seed=args.seed)
    loop = strategy.training_loop(model, optimizer, data, scheduler)
    total = epochs * len(data)
    victim = os.environ.get("TORCHSTRATEGIES_FT_WORKER") == "1" and os.environ.get("TORCHSTRATEGIES_FT_RESTART") == "0"

    def step_fn(batch: list[torch.Tensor]) -> torch.Tensor:
        """The ordinary step code; the loop redoes it if a worker is lost before backward() completes."""
        x, y = batch
        if victim and loop.steps == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step: its all-reduce never happens
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=args.batch_size)
        loss.backward()  # the step's commit point: after it .grad is the global gradient on every worker
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss.detach()  # this worker's rows' share of the global batch's loss

    try:
        while loop.steps < total:
            loop.step(step_fn)
            time.sleep(args.step_seconds)
    except ts.errors.CancelledError as exc:  # restarted after the others had finished: nothing to do
        print(f"worker {os.environ.get('TORCHSTRATEGIES_FT_WORKER')}: {exc}", file=sys.stderr)
        strategy.shutdown()
        return None

    with torch.no_grad():  # every worker holds the same model: evaluate the whole sets
        x, y = test_set.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
        loss = float(torch.nn.functional.cross_entropy(model(train_set.tensors[0]), train_set.tensors[1]))
    gen = loop.generation
    result = {"strategy": "FaultTolerantMultiWorkerMirroredStrategy", "accuracy": round(accuracy, 4),
              "steps": loop.steps, "aborted": loop.aborted, "loss": round(loss, 4),
              "workers": None if gen is None else gen.size, "healed_at": loop.healed_at}
    strategy.shutdown()
    if gen is not None and gen.index == 0:
        print(f"steps: {loop.steps}, discarded here: {loop.aborted}, held-out accuracy: {accuracy:.4f}")
        print("RESULT " + json.dumps(result), flush=True)
        return result
    return None


if __name__ == "__main__":
    main()
