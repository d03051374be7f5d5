"""ParameterServerStrategy training: with one worker, PS training equals single-device training.

One cluster (chief, 2 ps, 1 worker) with every parameter split over the two ps (FixedShardsPartitioner(2)),
so dense gradients are split by rows, sharded embedding tables move only touched rows, and optimizer state
lives on the ps shards. The single-device references are computed here, in this process.
"""

from __future__ import annotations

import os

import pytest
import torch
from _ps_bodies import assert_no_process_left, serve_or_train
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.partitioners import FixedShardsPartitioner

psutil = pytest.importorskip("psutil", reason="needs psutil, from the test extra: pip install -e '.[test]'")
os.environ.setdefault("TORCHSTRATEGIES_PS_SECRET", "test-job-secret-0123456789abcdef")   # the launch sets it

STEPS = 4


def _partitioner(shape, dtype):
    k = 5 if shape[0] == 13 else 2
    return FixedShardsPartitioner(k)(shape, dtype)


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class _EmbeddingModel(torch.nn.Module):
    def __init__(self, seed, rows, dim, sparse):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(rows, dim, sparse=sparse)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def _mlp_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(STEPS)]


def _id_batches(rows):
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, rows, (6, 3), generator=g), torch.randn(6, 1, generator=g)) for _ in range(STEPS)]


def _make(kind):
    """(model, optimizer factory, batches, loss) for each scenario, identical on the chief and here."""
    if kind == "mlp_sgd":
        return _mlp(0), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _mlp_batches(), "ce"
    if kind == "mlp_adam":
        return _mlp(1), lambda p: torch.optim.Adam(p, lr=0.01), _mlp_batches(), "ce"
    if kind == "emb_dense_adam":
        return _EmbeddingModel(2, 50, 4, False), lambda p: torch.optim.Adam(p, lr=0.05), _id_batches(50), "mse"
    if kind == "emb_sparse_sgd":
        return _EmbeddingModel(3, 4000, 8, True), lambda p: torch.optim.SGD(p, lr=0.5), _id_batches(4000), "mse"
    raise ValueError(kind)


KINDS = ["mlp_sgd", "mlp_adam", "emb_dense_adam", "emb_sparse_sgd"]


def _loss(kind, out, y):
    if kind == "ce":
        return torch.nn.functional.cross_entropy(out, y)
    return torch.nn.functional.mse_loss(out, y)


def _train_steps(model, opt, loss_kind, batches):
    for x, y in batches:
        opt.zero_grad()
        _loss(loss_kind, model(x), y).backward()
        opt.step()


def _scenarios(strategy):
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    out = {}
    for kind in KINDS:
        with strategy.scope():
            model, make_opt, batches, loss_kind = _make(kind)
            opt = make_opt(model.parameters())

        def step(x, y):
            opt.zero_grad()
            loss = _loss(loss_kind, model(x), y)
            loss.backward()
            opt.step()
            return loss

        def two_steps(pairs):                  # several steps in one closure see their own updates
            _train_steps(model, opt, loss_kind, pairs)

        before = coordinator.traffic()
        coordinator.schedule(step, args=batches[0])
        coordinator.schedule(two_steps, args=(batches[1:3],))
        for x, y in batches[3:]:
            coordinator.schedule(step, args=(x, y))
        coordinator.join()
        after = coordinator.traffic()
        out[kind] = {
            "state": {k: v.tolist() for k, v in model.state_dict().items()},
            "pushed": after["pushed_bytes"] - before["pushed_bytes"],
            "pulled": after["pulled_bytes"] - before["pulled_bytes"],
            "locations": {n: strategy.parameter_locations(p) for n, p in model.named_parameters()},
        }
    with strategy.scope():
        thirteen = torch.nn.Linear(4, 13)
    out["thirteen"] = strategy.parameter_locations(thirteen.weight)
    out["ps_vars"] = [strategy.ps_stats(i)["vars"] for i in range(2)]
    return out


def _cluster(rank, world_size, body):
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=2)
    return serve_or_train(resolver, body, variable_partitioner=_partitioner, timeout=30)


@pytest.fixture(scope="module")
def observed():
    results = run_ranks(_cluster, 4, args=(_scenarios,), init_process_group=False, timeout=150)
    assert results[1:] == ["ps", "ps", "worker"]
    assert_no_process_left()
    return results[0]


def _reference(kind):
    model, make_opt, batches, loss_kind = _make(kind)
    _train_steps(model, make_opt(model.parameters()), loss_kind, batches)
    return {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["mlp_sgd", "mlp_adam"])
def test_one_worker_dense_training_equals_single_device_exactly(observed, kind):
    assert observed[kind]["state"] == _reference(kind)


@pytest.mark.parametrize("kind", ["emb_dense_adam", "emb_sparse_sgd"])
def test_one_worker_sharded_embedding_training_equals_single_device(observed, kind):
    ref = _reference(kind)
    got = observed[kind]["state"]
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(torch.tensor(got[k], dtype=torch.float64), torch.tensor(ref[k], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7)
    # The model really changed (the comparison is not between two untouched initializations).
    model, *_ = _make(kind)
    assert got["emb.weight"] != model.state_dict()["emb.weight"].tolist()


def test_sharded_embedding_moves_only_touched_rows(observed):
    table_bytes = 4000 * 8 * 4
    per_step_pushed = observed["emb_sparse_sgd"]["pushed"] / STEPS
    per_step_pulled = observed["emb_sparse_sgd"]["pulled"] / STEPS
    # 18 ids per batch -> at most 18 rows of 32 bytes (+ ids) per step, against a 128 KB table.
    assert per_step_pushed < table_bytes / 50
    assert per_step_pulled < table_bytes / 50
    # A dense MLP pushes its whole gradient each step: (8*16 + 16 + 16*3 + 3) floats.
    assert observed["mlp_sgd"]["pushed"] == STEPS * (8 * 16 + 16 + 16 * 3 + 3) * 4


def test_parameters_are_split_into_row_shards_round_robin(observed):
    assert [(start, stop) for _, start, stop in observed["thirteen"]] == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    ps = [p for p, _, _ in observed["thirteen"]]
    assert all(a != b for a, b in zip(ps, ps[1:]))                   # consecutive shards alternate ps
    locs = observed["emb_sparse_sgd"]["locations"]
    assert [(s, e) for _, s, e in locs["emb.weight"]] == [(0, 2000), (2000, 4000)]
    assert {p for p, _, _ in locs["emb.weight"]} == {0, 1}
    shapes = sorted(shape for ps_vars in observed["ps_vars"] for shape in ps_vars.values())
    for rows in (3, 3, 3, 2, 2):
        assert (rows, 4) in shapes
