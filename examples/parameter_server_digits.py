"""Train a small network on scikit-learn's digits with ParameterServerStrategy (asynchronous, fault tolerant).

    export TORCHSTRATEGIES_PS_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')  # per job
    torchrun --standalone --nproc_per_node=4 examples/parameter_server_digits.py            # chief, 1 ps, 2 workers
    torchrun --standalone --nproc_per_node=4 examples/parameter_server_digits.py --fast

The same script runs on every rank: rank 0 is the chief (it builds the model under ``strategy.scope()`` and
schedules training steps), ranks 1..num_ps are parameter servers, the rest are workers; ps and workers just
run ``Server(resolver).join()``. The chief shows the progress bar; with ``--result-json PATH`` it writes
``{"strategy": "ParameterServerStrategy", "accuracy": ..., "samples_per_sec": ...}`` there.
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


def load(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (xtr, ytr), (xte, yte)


def make_dataset_fn(batch_size: int, seed: int):
    def dataset_fn(input_context):
        """Runs on each worker: its own shard of the training set, reshuffled every pass, forever."""
        (x, y), _ = load(seed)
        shard = torch.arange(input_context.worker_index, len(x), input_context.num_workers)
        x, y = x[shard], y[shard]
        g = torch.Generator().manual_seed(seed + input_context.worker_index)

        def batches():
            while True:
                order = torch.randperm(len(x), generator=g)
                for i in range(0, len(x) - batch_size + 1, batch_size):
                    idx = order[i:i + batch_size]
                    yield x[idx], y[idx]

        return batches()

    return dataset_fn


def write_result(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--fast", action="store_true", help="a few seconds: fewer epochs")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per-step batch on one worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", metavar="PATH", help="write the result (strategy, accuracy, samples_per_sec) "
                   "as JSON to PATH (what `make demo` reads)")
    args = p.parse_args(argv)
    epochs = min(args.epochs, 6) if args.fast else args.epochs

    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=args.num_ps)
    if resolver.task_type in ("ps", "worker"):
        ts.distribute.Server(resolver).join()      # serves until the chief is done
        return None

    from tqdm import tqdm

    torch.manual_seed(args.seed)
    strategy = ts.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    per_worker_iter = iter(coordinator.create_per_worker_dataset(make_dataset_fn(args.batch_size, args.seed)))

    def train_step(iterator):
        x, y = next(iterator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    (xtr, _), (xte, yte) = load(args.seed)
    steps_per_epoch = len(xtr) // args.batch_size
    n_workers = resolver.cluster_spec().num_tasks("worker")
    bar = tqdm(total=epochs * steps_per_epoch, desc=f"ParameterServerStrategy {args.num_ps} ps x {n_workers} workers",
               unit="step")
    start = time.perf_counter()
    for _ in range(epochs):
        losses = [coordinator.schedule(train_step, args=(per_worker_iter,)) for _ in range(steps_per_epoch)]
        coordinator.join()
        bar.update(steps_per_epoch)
        bar.set_postfix(loss=f"{sum(float(r.fetch()) for r in losses) / len(losses):.4f}")
    elapsed = time.perf_counter() - start
    bar.close()

    with torch.no_grad():                    # the chief's copy is refreshed from the ps before its forward
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    traffic = coordinator.traffic()
    result = {
        "strategy": "ParameterServerStrategy",
        "accuracy": round(accuracy, 4),
        "samples_per_sec": round(epochs * steps_per_epoch * args.batch_size / elapsed, 1),
    }
    print(f"pulled {traffic['pulled_bytes'] / traffic['closures']:.0f} B and pushed "
          f"{traffic['pushed_bytes'] / traffic['closures']:.0f} B per step", file=sys.stderr)
    strategy.shutdown()
    print(f"held-out accuracy {accuracy:.4f}")
    write_result(result, args.result_json)
    return result


if __name__ == "__main__":
    main()
