"""Rank bodies for tests/test_collectives_ring.py (top-level so spawn can pickle them)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from _fault_bodies import fault_outcome

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
OPS = {"SUM": dist.ReduceOp.SUM, "MEAN": dist.ReduceOp.AVG, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
       "PRODUCT": dist.ReduceOp.PRODUCT}


def _reference(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """Every rank's input gathered with gloo and reduced with torch (float64 accumulation for floats)."""
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    st = torch.stack(xs)
    if op == "SUM":
        return st.sum(0, dtype=st.dtype)
    if op == "MEAN":
        return (st.double().sum(0) / world).to(x.dtype)
    if op == "MIN":
        return st.amin(0)
    if op == "MAX":
        return st.amax(0)
    out = st[0].clone()
    for row in st[1:]:
        out = out * row
    return out


def every_op_and_dtype(rank: int, world: int) -> list[str]:
    """Each op x dtype x size (0, 1, below the world size, uneven, several staging chunks on the ring path)
    on a RING group of the backend, against torch; every rank's result must also be bitwise the same."""
    import torchstrategies  # noqa: F401
    from torchstrategies.collectives import BackendOptions

    os.environ["TORCHSTRATEGIES_RING_CHUNK_BYTES"] = "4096"  # many staging refills on the ring path
    g = dist.new_group(backend="torchstrategies", pg_options=BackendOptions("RING", 30))
    del os.environ["TORCHSTRATEGIES_RING_CHUNK_BYTES"]
    big = dist.new_group(backend="torchstrategies", pg_options=BackendOptions("RING", 30))
    fails: list[str] = []
    gen = torch.Generator().manual_seed(1234 + rank)
    sizes = [0, 1, max(world - 1, 1), 1001, 40_003]  # 40_003 x 2-8 bytes: above SMALL_BYTES, the ring path
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        for n in sizes:
            base = torch.randint(-8, 9, (n,), generator=gen)
            for op in OPS:
                if op == "MEAN" and not dt.is_floating_point:
                    continue
                x = (base.clamp(-2, 2) if op == "PRODUCT" else base).to(dt)
                want = _reference(x, op, world)
                got = x.clone()
                dist.all_reduce(got, op=OPS[op], group=g)
                tol = {"float16": 1e-2, "bfloat16": 2e-2}.get(dt_name, 1e-6)
                ok = (torch.allclose(got.double(), want.double(), rtol=tol, atol=tol) if dt.is_floating_point
                      else torch.equal(got, want))
                if not ok:
                    fails.append(f"{op} {dt_name} n={n}: {got[:6].tolist()} != {want[:6].tolist()}")
                same = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(same, got)
                if not all(torch.equal(s.view(torch.uint8) if s.numel() else s, got.view(torch.uint8)
                                       if got.numel() else got) for s in same):
                    fails.append(f"{op} {dt_name} n={n}: ranks disagree")
    same_gen = torch.Generator().manual_seed(99)  # the same x on every rank
    for dt in (torch.float32, torch.int64):  # above 4 MiB: the ring sends from its second thread
        x = torch.randint(-8, 9, (1_200_001,), generator=same_gen).to(dt)
        for op in ("SUM", "MIN"):
            got = x.clone()
            dist.all_reduce(got, op=OPS[op], group=big)
            if not torch.equal(got, _reference(x, op, world)):
                fails.append(f"{op} {dt} n=1_200_001 (threaded sender)")
        full = torch.cat([x] * world)
        part = torch.empty_like(x)
        dist.reduce_scatter_tensor(part, full, group=big)
        if not torch.equal(part, x * world):
            fails.append(f"reduce_scatter {dt} n=1_200_001 (threaded sender)")
        gathered = torch.empty(world * x.numel(), dtype=dt)
        dist.all_gather_into_tensor(gathered, x + rank, group=big)
        if not torch.equal(gathered, torch.cat([x + r for r in range(world)])):
            fails.append(f"all_gather {dt} n=1_200_001 (threaded sender)")
        b = x + rank
        dist.broadcast(b, src=world - 1, group=big)
        if not torch.equal(b, x + world - 1):
            fails.append(f"broadcast {dt} n=1_200_001 (threaded sender)")
    return fails


def mismatch_one_rank(rank: int, world: int) -> dict:
    """Only rank 1 differs (size, then dtype, then op): every rank raises ValueError; the ring recovers."""
    from torchstrategies import collectives as C

    opts = C.CommunicationOptions(implementation="RING", timeout_seconds=20)
    odd = rank == 1
    cases = {
        "size": lambda: C.all_reduce(torch.ones(100_000 + (7 if odd else 0)), options=opts),
        "dtype": lambda: C.all_reduce(torch.ones(9, dtype=torch.float64 if odd else torch.float32), options=opts),
        "op": lambda: C.all_reduce(torch.ones(9), op="max" if odd else "sum", options=opts),
    }
    out: dict = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001 - the test reports it
            out[name] = f"{type(e).__name__}: {e}"
        out[name + "_after"] = C.all_reduce(torch.full((3,), float(rank + 1)), options=opts).tolist()
    return out


def fault_mid_exchange(rank: int, world: int, how: str, timeout: float) -> tuple:
    """The last rank SIGKILLs / SIGSTOPs itself while every rank loops large ring all-reduces (the others are
    inside the data exchange); the others report (error type, message)."""
    from torchstrategies import collectives as C

    opts = C.CommunicationOptions(implementation="RING", timeout_seconds=timeout)
    x = torch.ones(1 << 21)  # 8 MiB: each call spends its time in the exchange
    C.all_reduce_(x, options=opts)
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    victim = world - 1
    if rank == victim:
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        threading.Timer(0.3, lambda: os.kill(os.getpid(), sig)).start()
    t0 = time.monotonic()

    def loop() -> None:
        while time.monotonic() - t0 < 60:
            C.all_reduce_(x, options=opts)

    return fault_outcome(loop, how, rank, victim, pids[victim], "ring_fault")


def hierarchical_uses_ring(rank: int, world: int) -> dict:
    """2 simulated hosts x 2 ranks: HIERARCHICAL runs its leader stage on the ring, results match torch."""
    from torchstrategies import collectives as C
    from torchstrategies._ext import _C

    opts = C.CommunicationOptions(implementation="HIERARCHICAL")
    out: dict = {"fails": []}
    for n in (3, 100_001):
        for op in ("SUM", "MAX"):
            x = torch.arange(n, dtype=torch.float32) * (rank + 1)
            got = C.all_reduce(x, op=op, options=opts)
            want = _reference(x, op, world)
            if not torch.equal(got, want):
                out["fails"].append(f"{op} n={n}")
    out["plan"] = tuple(_C.backend_plan(C.api._target(None, C.CommunicationImplementation.HIERARCHICAL, False).obj))
    return out


def auto_between_hosts(rank: int, world: int) -> dict:
    """Ranks on two simulated hosts, one rank each: AUTO resolves to RING and is right."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationImplementation as I

    x = torch.full((5,), float(rank + 1))
    return {"auto": C.choose(I.AUTO, [x], None).name, "value": C.all_reduce(x, op="mean").tolist()}
