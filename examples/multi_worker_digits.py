"""Train a small network on scikit-learn's digits with MultiWorkerMirroredStrategy, one process per worker.

    torchrun --standalone --nproc_per_node=2 examples/multi_worker_digits.py --epochs 20
    torchrun --standalone --nproc_per_node=2 examples/multi_worker_digits.py --fast
    python examples/multi_worker_digits.py --fast          # one worker, no torchrun needed

Each worker reads only its half of every global batch; gradients are summed across workers during
backward. Rank 0 alone shows a progress bar and prints the held-out accuracy; with ``--result-json PATH`` it
writes ``{"strategy": "MultiWorkerMirroredStrategy", "accuracy": ..., "samples_per_sec": ...}`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

try:
    import torchstrategies as ts
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torchstrategies as ts

from mirrored_digits import load  # noqa: E402  (same directory: the same split of the digits)


def _single_worker_env() -> None:
    """Without torchrun, describe a one-worker cluster so the example still runs."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--fast", action="store_true", help="a few seconds: fewer epochs")
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size (all workers together)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--implementation", default="AUTO", help="how workers talk: AUTO, SHM, RING, HIERARCHICAL, GLOO")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", metavar="PATH", help="write the result (strategy, accuracy, samples_per_sec) "
                   "as JSON to PATH (what `make demo` reads)")
    args = p.parse_args(argv)
    epochs = min(args.epochs, 10) if args.fast else args.epochs

    _single_worker_env()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    options = None if args.implementation == "AUTO" else ts.CommunicationOptions(implementation=args.implementation)
    strategy = ts.MultiWorkerMirroredStrategy(communication_options=options)
    chief = strategy.extended.should_checkpoint
    train_set, test_set = load(args.seed)

    with strategy.scope():  # rank 0's initial weights are broadcast to every worker
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    train_data = strategy.experimental_distribute_dataset(loader)
    test_data = strategy.experimental_distribute_dataset(DataLoader(test_set, batch_size=args.batch_size))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=args.batch_size)
        loss.backward()  # gradients are summed across workers during backward
        optimizer.step()
        optimizer.zero_grad()
        return loss

    bar = tqdm(total=epochs * len(train_data), desc="train", disable=not chief, file=sys.stderr)
    start, seen = time.perf_counter(), 0
    for epoch in range(epochs):
        train_data.set_epoch(epoch)  # the same shuffle on every worker, a new one each epoch
        for x, y in train_data:
            loss = strategy.run(train_step, args=(x, y))
            seen += x.shape[0]
            bar.update(1)
        bar.set_postfix(epoch=epoch, loss=f"{float(strategy.reduce('sum', loss, axis=None)):.3f}")
    elapsed = time.perf_counter() - start
    bar.close()
    samples = float(strategy.reduce("sum", torch.tensor(float(seen)), axis=None))

    correct = torch.tensor(0.0)
    count = torch.tensor(0.0)
    with torch.no_grad():
        for x, y in test_data:  # each worker evaluates its part of the held-out set
            correct += (model(x).argmax(1) == y).sum()
            count += y.shape[0]
    accuracy = float(strategy.reduce("sum", correct, axis=None) / strategy.reduce("sum", count, axis=None))
    result = {"strategy": "MultiWorkerMirroredStrategy", "accuracy": round(accuracy, 4),
              "samples_per_sec": round(samples / elapsed, 1)}
    strategy.shutdown()
    if chief:
        print(f"workers: {strategy.num_replicas_in_sync}, epochs: {epochs}, held-out accuracy: {accuracy:.4f}")
        write_result(result, args.result_json)
    return result


if __name__ == "__main__":
    main()
