"""Where a small ``dist.all_reduce`` on the "torchstrategies" backend spends its time: the same 4 KiB call
through each layer, in one process (a group of one: no peer to wait for, so the figures are the layers' own
cost), the rows interleaved round by round.

Run:
    python tests/scripts/ab_backend_call_layers.py --rounds 15 --iters 20000

Rows (minimum and median over the rounds of the mean µs per call):
    shm-comm                      the shared-memory communicator called directly (``_C.ShmComm``): the floor
    torch no-op dist.all_reduce   ``dist.all_reduce`` on torch's own FakeProcessGroup, a backend that does
                                  nothing: what torch's Python wrapper, ProcessGroup, dispatcher and Work cost
                                  any backend
    torch no-op pg.allreduce      the same without ``dist.all_reduce``'s Python (prebuilt options)
    dist.all_reduce               on a "torchstrategies" group: ours minus the no-op row is this backend's cost
    pg.allreduce                  the same without ``dist.all_reduce``'s Python
    async_op=True + wait()        handed to the backend's worker thread and waited for
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers torch's "fake" backend
from torch._C._distributed_c10d import AllreduceOptions, ReduceOp

import torchstrategies  # noqa: F401 - registers the backend
from torchstrategies._ext import _C
from torchstrategies.collectives.backend import shm_slot_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--numel", type=int, default=1024, help="float32 elements (1024: 4 KiB)")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ours = dist.new_group(backend="torchstrategies")
    noop = dist.new_group(backend="fake")
    comm = _C.ShmComm(f"/ts_ab_layers_{os.getpid()}", 0, 1, shm_slot_bytes(), True)
    comm.attach(10.0)
    t = torch.ones(a.numel)
    tensors = [t]
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    opts.asyncOp = False
    code = int(_C.REDUCE_OP_CODES["SUM"])
    rows: dict[str, Callable[[], object]] = {
        "shm-comm": lambda: comm.all_reduce_(t, code, 300.0),
        "torch no-op dist.all_reduce": lambda: dist.all_reduce(t, group=noop),
        "torch no-op pg.allreduce": lambda: noop.allreduce(tensors, opts).wait(),
        "dist.all_reduce": lambda: dist.all_reduce(t, group=ours),
        "pg.allreduce": lambda: ours.allreduce(tensors, opts).wait(),
        "async_op=True + wait()": lambda: dist.all_reduce(t, group=ours, async_op=True).wait(),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(a.rounds):
        for name, call in rows.items():
            for _ in range(200):
                call()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                call()
            times[name].append((time.perf_counter() - t0) / a.iters * 1e6)
    print(f"{a.numel * 4} bytes, {a.rounds} rounds of {a.iters} calls, 1-minute load at the end "
          f"{os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"{name:30s} min {min(ts):7.3f}  median {statistics.median(ts):7.3f} us/call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
