"""A large sparse embedding table sharded over 2 parameter servers, trained on scikit-learn's digits.

    export TORCHSTRATEGIES_PS_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')  # per job
    torchrun --standalone --nproc_per_node=5 examples/parameter_server_embedding.py           # chief, 2 ps, 2 workers
    torchrun --standalone --nproc_per_node=5 examples/parameter_server_embedding.py --fast

Each 8x8 digit becomes a bag of 64 tokens, one per pixel (position, intensity), hashed into the rows of an ``nn.Embedding(--rows, 32, sparse=True)`` table (default 200,000 rows, 25.6 MB) that
``FixedShardsPartitioner(2)`` splits into two contiguous row shards, one per ps. A step touches only the few
hundred rows its batch uses: the worker pulls those rows, and pushes only their gradients (a sparse update the
ps apply with Adagrad), so the bytes per step stay tiny next to the table, as the chief reports at the end.
``--result-json PATH`` writes ``{"strategy": "ParameterServerStrategy", "accuracy": ..., "samples_per_sec": ...}``
there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

try:
    import torchstrategies as ts
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torchstrategies as ts

from parameter_server_digits import load  # noqa: E402  (same directory)


def features(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, 64] pixel intensities in [0, 1] -> [n, 64] hashed (position, intensity) token ids in [0, rows)."""
    v = (x * 16).round().long()
    ids = torch.arange(64).unsqueeze(0) * 17 + v
    return (ids * 2654435761) % rows


class BagModel(torch.nn.Module):
    def __init__(self, rows: int, dim: int = 32):
        super().__init__()
        self.table = torch.nn.Embedding(rows, dim, sparse=True)
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, ids):
        return self.head(torch.relu(self.table(ids).sum(1)))


def make_dataset_fn(batch_size: int, rows: int, seed: int):
    def dataset_fn(input_context):
        (x, y), _ = load(seed)
        shard = torch.arange(input_context.worker_index, len(x), input_context.num_workers)
        ids, y = features(x[shard], rows), y[shard]
        g = torch.Generator().manual_seed(seed + input_context.worker_index)

        def batches():
            while True:
                order = torch.randperm(len(ids), generator=g)
                for i in range(0, len(ids) - batch_size + 1, batch_size):
                    yield ids[order[i:i + batch_size]], y[order[i:i + batch_size]]

        return batches()

    return dataset_fn


def write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--fast", action="store_true", help="a few seconds: fewer epochs")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the embedding table")
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", metavar="PATH", help="write the result (strategy, accuracy, samples_per_sec) "
                   "as JSON to PATH (what `make demo` reads)")
    args = p.parse_args(argv)
    epochs = min(args.epochs, 4) if args.fast else args.epochs

    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=args.num_ps)
    if resolver.task_type in ("ps", "worker"):
        ts.distribute.Server(resolver).join()
        return None

    from tqdm import tqdm

    torch.manual_seed(args.seed)
    strategy = ts.ParameterServerStrategy(
        resolver, variable_partitioner=ts.partitioners.FixedShardsPartitioner(args.num_ps))
    with strategy.scope():
        model = BagModel(args.rows)
        with torch.no_grad():
            model.table.weight.mul_(0.1)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    shards = strategy.parameter_locations(model.table.weight)
    print(f"embedding table {tuple(model.table.weight.shape)}: shards (ps, first row, end) {shards}", file=sys.stderr)
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    per_worker_iter = iter(coordinator.create_per_worker_dataset(
        make_dataset_fn(args.batch_size, args.rows, args.seed)))

    def train_step(iterator):
        ids, y = next(iterator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    (xtr, _), (xte, yte) = load(args.seed)
    steps_per_epoch = len(xtr) // args.batch_size
    bar = tqdm(total=epochs * steps_per_epoch, desc="ParameterServerStrategy sparse embedding", unit="step")
    start = time.perf_counter()
    for _ in range(epochs):
        losses = [coordinator.schedule(train_step, args=(per_worker_iter,)) for _ in range(steps_per_epoch)]
        coordinator.join()
        bar.update(steps_per_epoch)
        bar.set_postfix(loss=f"{sum(float(r.fetch()) for r in losses) / len(losses):.4f}")
    elapsed = time.perf_counter() - start
    bar.close()

    with torch.no_grad():
        accuracy = (model(features(xte, args.rows)).argmax(1) == yte).float().mean().item()
    t = coordinator.traffic()
    table_bytes = model.table.weight.numel() * 4
    print(f"per step: pulled {t['pulled_bytes'] / t['closures']:.0f} B, pushed {t['pushed_bytes'] / t['closures']:.0f} B "
          f"(the table is {table_bytes} B)", file=sys.stderr)
    result = {
        "strategy": "ParameterServerStrategy",
        "accuracy": round(accuracy, 4),
        "samples_per_sec": round(epochs * steps_per_epoch * args.batch_size / elapsed, 1),
    }
    strategy.shutdown()
    print(f"held-out accuracy {accuracy:.4f}")
    write_result(result, args.result_json)
    return result


if __name__ == "__main__":
    main()
