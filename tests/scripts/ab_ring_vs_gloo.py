"""A/B of our C++ TCP ring (a RING group of the "torchstrategies" backend) against gloo's all_reduce,
interleaved in one run (medians per size).

Run (ws=2 on one machine, loopback):
    torchrun --standalone --nproc_per_node 2 tests/scripts/ab_ring_vs_gloo.py --sizes 4096,1048576,67108864

Rank 0 prints one line per size: bytes, gloo median us, ring median us, and gloo/ring (above 1: ring faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864")
    p.add_argument("--iters", type=int, default=0, help="rounds per size (0: by size)")
    a = p.parse_args()
    from torchstrategies.collectives import BackendOptions
    from torchstrategies.strategies._mw_cluster import import_dynamo_first

    import_dynamo_first()  # before the group: else its gloo threads may abort the exit (_mw_cluster.py)
    dist.init_process_group("gloo")

    ring = dist.new_group(backend="torchstrategies", pg_options=BackendOptions("RING", 60))

    for nbytes in (int(s) for s in a.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        iters = a.iters or max(5, min(200, (64 << 20) // max(nbytes, 1) // 4))
        for _ in range(3):  # warm-up (connections, buffers)
            dist.all_reduce(x)
            dist.all_reduce(x, group=ring)
        tg, tr = [], []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            tg.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=ring)
            tr.append(time.perf_counter() - t0)
        g, r = statistics.median(tg) * 1e6, statistics.median(tr) * 1e6
        if dist.get_rank() == 0:
            print(f"{nbytes:>10} gloo {g:10.1f} us  ring {r:10.1f} us  gloo/ring {g / r:5.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
