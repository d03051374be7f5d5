"""Train a small network on scikit-learn's digits with MirroredStrategy (CPU replicas or GPUs).

    python examples/mirrored_digits.py --replicas 2 --epochs 30
    python examples/mirrored_digits.py --fast

``--result-json PATH`` writes ``{"strategy": "MirroredStrategy", "accuracy": ..., "samples_per_sec": ...}`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

try:
    import torchstrategies as ts
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torchstrategies as ts


def load(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return TensorDataset(xtr, ytr), TensorDataset(xte, yte)


def write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--fast", action="store_true", help="a few seconds: fewer epochs")
    p.add_argument("--replicas", type=int, default=2, help="number of CPU replicas (ignored with --devices)")
    p.add_argument("--devices", nargs="*", default=None, help='e.g. "cuda:0" "cuda:1"')
    p.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--aggregation", default="ADD_N", choices=[m.name for m in list(ts.AggregationMethod)[:3]])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", metavar="PATH", help="write the result (strategy, accuracy, samples_per_sec) "
                   "as JSON to PATH (what `make demo` reads)")
    args = p.parse_args(argv)
    epochs = min(args.epochs, 12) if args.fast else args.epochs

    torch.manual_seed(args.seed)
    ops = ts.ReductionToOneDevice(accumulation_fn=ts.AggregationMethod[args.aggregation])
    if args.devices:
        strategy = ts.MirroredStrategy(args.devices)
    else:
        strategy = ts.MirroredStrategy(num_replicas=args.replicas, cross_device_ops=ops)
    train_set, test_set = load(args.seed)

    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = ts.compute_average_loss(loss_fn(model(x), y))
        loss.backward()
        optimizer.step()
        return loss.detach()

    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    dist = strategy.experimental_distribute_dataset(loader)
    samples, start = 0, time.perf_counter()
    bar = tqdm(range(epochs), desc=f"MirroredStrategy x{strategy.num_replicas_in_sync}", unit="epoch")
    for _ in bar:
        total, steps = 0.0, 0
        for x, y in dist:
            total += strategy.reduce("sum", strategy.run(train_step, args=(x, y)), axis=None).item()
            steps += 1
        samples += len(train_set)
        bar.set_postfix(loss=f"{total / max(steps, 1):.4f}")
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        x = x.to(strategy.extended.parameter_devices[0])
        accuracy = float((model(x).argmax(1).cpu() == y).float().mean())
    result = {
        "strategy": "MirroredStrategy",
        "accuracy": round(accuracy, 4),
        "samples_per_sec": round(samples / elapsed, 1),
    }
    print(f"held-out accuracy {accuracy:.4f} with {strategy.num_replicas_in_sync} replicas")
    write_result(result, args.result_json)
    return result


if __name__ == "__main__":
    main()
