"""MultiWorkerMirroredStrategy trains exactly like one process with the global batch, and like torch DDP."""

from __future__ import annotations

import pytest
import torch

from tests._mw_common import (
    GLOBAL_BATCH,
    LR,
    STEPS,
    assert_params_close,
    make_data,
    make_model,
    params_of,
    reference_params,
    shard,
)
from tests.harness import run_ranks


def _configs():
    """(implementation name, bytes_per_pack) pairs: every implementation that picks a CPU process group,
    packing on (one pack / 256 B packs) and off (1-byte packs: one tensor per bucket)."""
    out = [(impl, 0) for impl in ("AUTO", "SHM", "RING", "HIERARCHICAL", "GLOO")]
    out += [("AUTO", 256), ("AUTO", 1), ("GLOO", 1)]
    return out


def _train_ours(rank, world, impl, bytes_per_pack, seed):
    from torchstrategies import CommunicationOptions
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    options = CommunicationOptions(bytes_per_pack=bytes_per_pack, implementation=impl)
    strategy = MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.num_replicas_in_sync == world
    with strategy.scope():
        model = make_model(seed)  # a different seed on every rank: the broadcast must fix it
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = make_data()

    def step(x, y):
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = per_example.sum() / GLOBAL_BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for s in range(STEPS):
        strategy.run(step, args=(shard(xs[s], rank, world), shard(ys[s], rank, world)))
    out = params_of(model)
    strategy.shutdown()
    return out


def _train_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(rank))  # DDP broadcasts rank 0's initial values too (seed 0, as ours)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = make_data()
    b = GLOBAL_BATCH // world
    for s in range(STEPS):
        loss = torch.nn.functional.cross_entropy(model(shard(xs[s], rank, world)), shard(ys[s], rank, world),
                                                 reduction="sum") / b  # DDP averages: mean over the local batch
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params_of(model.module)


def _parity_body(rank, world, configs):
    results = {}
    for impl, bpp in configs:
        # Rank r starts from seed r; the broadcast makes everyone start from rank 0's seed (0).
        results[(impl, bpp)] = _train_ours(rank, world, impl, bpp, seed=rank)
    results["ddp"] = _train_ddp(rank, world)
    return results


def _check(results_by_rank, world):
    ref = reference_params(init_seed=0)
    for rank, results in enumerate(results_by_rank):
        for key, params in results.items():
            assert_params_close(params, ref, what=f"{key} rank {rank} of {world}")  # = one process, global batch
            # = torch DDP trained the same way from the same initial values
            assert_params_close(params, results["ddp"], rtol=1e-5, atol=1e-7, what=f"{key} vs DDP rank {rank}")
            # every worker ends identical, bit for bit
            for p, q in zip(params, results_by_rank[0][key]):
                assert (p == q).all(), f"{key}: rank {rank} differs from rank 0"


@pytest.mark.timeout(120)
def test_two_workers_match_single_process_and_torch_ddp_for_every_implementation_and_packing():
    configs = _configs()
    results = run_ranks(_parity_body, 2, args=(configs,), timeout=110)
    _check(results, 2)


def _four_worker_body(rank, world):
    import os

    out = {"1x4": _train_ours(rank, world, "AUTO", 256, seed=rank)}  # several buckets
    # now 2 simulated hosts x 2 ranks; each strategy makes its own group, which reads the host identity
    os.environ["TORCHSTRATEGIES_HOST_ID"] = f"host{rank // 2}"
    out["2x2"] = _train_ours(rank, world, "AUTO", 256, seed=rank)
    return out


@pytest.mark.timeout(150)
def test_four_workers_on_two_simulated_hosts_train_like_one_host_and_one_process():
    results = run_ranks(_four_worker_body, 4, timeout=140)
    ref = reference_params(init_seed=0)
    for rank, res in enumerate(results):
        for key in ("1x4", "2x2"):
            assert_params_close(res[key], ref, what=f"{key} rank {rank} of 4")
            for p, q in zip(res[key], results[0][key]):
                assert (p == q).all(), f"{key}: rank {rank} differs from rank 0"
        assert_params_close(res["2x2"], res["1x4"], rtol=1e-6, atol=1e-7, what="2x2 vs 1x4")
