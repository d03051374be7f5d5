"""Rank bodies for tests/test_collectives*.py (top-level so spawn can pickle them)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def make(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def reference(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """torch.distributed's own all_reduce (gloo), MEAN as SUM / world, in float64 for floats."""
    y = x.to(torch.float64).clone() if x.is_floating_point() else x.clone()
    dop = {"SUM": dist.ReduceOp.SUM, "MEAN": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX}[op]
    dist.all_reduce(y, op=dop)
    if op == "MEAN":
        y = y / world
    return y


def tol(dtype: torch.dtype, world: int) -> tuple[float, float]:
    return {
        torch.float32: (1e-5 * world, 1e-5),
        torch.float64: (1e-12, 1e-12),
        torch.bfloat16: (2e-2 * world, 2e-2),
        torch.float16: (2e-3 * world, 2e-3),
    }.get(dtype, (0.0, 0.0))


def matrix(rank: int, world: int, impls: list[str], ops: list[str], dtypes: list[str], sizes: list[int],
           big: list[tuple[str, str, str]] = ()) -> list[str]:
    """Runs every combination against gloo's all_reduce; returns a list of failures (empty = ok)."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationOptions

    fails = []
    cases = [(i, o, d, s) for i in impls for o in ops for d in dtypes for s in sizes]
    cases += [(i, o, d, (1 << 20) + 3) for (i, o, d) in big]
    for k, (impl, op, dname, n) in enumerate(cases):
        dtype = DTYPES[dname]
        if op == "MEAN" and not dtype.is_floating_point:
            continue
        x = make(rank, n, dtype, k)
        ref = reference(x, op, world)
        if impl == "SHM-BUF":  # the zero-copy path: the tensor lives in the shared segment
            opts = CommunicationOptions(implementation="SHM", timeout_seconds=60)
            x2 = C.buffer(n, dtype)[:n]
            x2.copy_(x)
            C.all_reduce_(x2, op=op, options=opts)
            out = x2.clone()
        else:
            opts = CommunicationOptions(implementation=impl, timeout_seconds=60)
            out = C.all_reduce(x, op=op, options=opts)
            x2 = x.clone()
            C.all_reduce_([x2], op=op, options=opts)
        for name, got in (("all_reduce", out), ("all_reduce_", x2)):
            if got.dtype != dtype or got.shape != x.shape:
                fails.append(f"{impl} {op} {dname} n={n} {name}: got {got.dtype} {tuple(got.shape)}")
                continue
            atol, rtol = tol(dtype, world)
            if not torch.allclose(got.to(ref.dtype), ref.to(got.dtype).to(ref.dtype), atol=atol, rtol=rtol):
                err = (got.to(torch.float64) - ref.to(torch.float64)).abs().max().item()
                fails.append(f"{impl} {op} {dname} n={n} {name}: max error {err}")
        # Every rank must hold identical bits.
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out)
        if any(not torch.equal(g.view(torch.uint8) if g.numel() else g, out.view(torch.uint8) if out.numel() else out)
               for g in gathered):
            fails.append(f"{impl} {op} {dname} n={n}: ranks disagree")
    return fails


def packing(rank: int, world: int, impls: list[str]) -> list[str]:
    """Many tensors of mixed dtypes and shapes (one non-contiguous), packed into small buckets."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationOptions

    fails = []
    for impl in impls:
        for bpp in (0, 1000):
            g = torch.Generator().manual_seed(7 + rank)
            ts = []
            for i in range(23):
                dtype = [torch.float32, torch.float64, torch.int64][i % 3]
                shape = [(i + 1,), (3, i + 2), ()][i % 3]
                t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
                ts.append(t)
            ts.append(torch.randn(6, 5, generator=g).t())  # non-contiguous
            refs = [reference(t.reshape(-1), "SUM", world).view(t.shape) for t in ts]
            got = [t.clone() for t in ts]
            got[-1] = ts[-1].clone().t().contiguous().t()
            opts = CommunicationOptions(implementation=impl, bytes_per_pack=bpp, timeout_seconds=60)
            C.all_reduce_(got, op="sum", options=opts)
            outs = C.all_reduce(ts, op="sum", options=opts)
            for i, (a, b, r) in enumerate(zip(got, outs, refs)):
                for name, v in (("in place", a), ("returned", b)):
                    if v.dtype != ts[i].dtype or v.shape != ts[i].shape or not torch.allclose(
                        v.to(torch.float64), r.to(torch.float64), atol=1e-4, rtol=1e-5
                    ):
                        fails.append(f"{impl} bytes_per_pack={bpp} tensor {i} {name} wrong")
            if not torch.equal(ts[0], ts[0]):
                fails.append("input modified")
    return fails


def in_shared_segment(t: torch.Tensor) -> bool:
    """True if ``t``'s memory lies in a mapping of one of our /dev/shm segments."""
    p = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/torchstrat" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= p < hi:
                    return True
    return False


def async_and_buffers(rank: int, world: int) -> dict:
    from torchstrategies import collectives as C

    buf = C.buffer(1000, torch.float32)
    in_shm = in_shared_segment(buf)
    buf.copy_(torch.arange(1000, dtype=torch.float32) * (rank + 1))
    h = C.all_reduce_async(buf, op="sum", options=C.CommunicationOptions(timeout_seconds=30))
    other = torch.full((5,), float(rank))
    ring = C.CommunicationOptions(implementation="RING", timeout_seconds=30)
    h2 = C.all_reduce_async([other], op="max", options=ring)
    res = h.wait()
    (o2,) = h2.wait()
    expect = torch.arange(1000, dtype=torch.float64) * sum(range(1, world + 1))
    # broadcast and all_gather
    b = torch.full((3, 3), float(rank))
    C.broadcast(b, src=world - 1, options=C.CommunicationOptions(implementation="SHM"))
    g_shm = C.all_gather(torch.full((2,), float(rank)), options=C.CommunicationOptions(implementation="SHM"))
    g_gloo = C.all_gather(torch.full((2,), float(rank)), options=C.CommunicationOptions(implementation="GLOO"))
    bg = torch.full((4,), float(rank))
    C.broadcast(bg, src=0, options=C.CommunicationOptions(implementation="GLOO"))
    return {
        "in_shm": in_shm,
        "same_object": res is buf,
        "futures": isinstance(h, torch.futures.Future) and isinstance(h2, torch.futures.Future),
        "buf_ok": torch.equal(buf.double(), expect),
        "max_ok": torch.equal(o2, torch.full((5,), float(world - 1))),
        "bcast_ok": torch.equal(b, torch.full((3, 3), float(world - 1))),
        "bcast_gloo_ok": torch.equal(bg, torch.zeros(4)),
        "gather_ok": torch.equal(g_shm, torch.arange(world).float().repeat_interleave(2))
        and torch.equal(g_gloo, g_shm),
    }


def hierarchical(rank: int, world: int) -> dict:
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationImplementation as I
    from torchstrategies.collectives import topology

    fails = matrix(rank, world, ["HIERARCHICAL", "AUTO"], ["SUM", "MEAN", "MAX"], ["float32", "int64"], [1, 4099])
    chosen = C.choose(I.AUTO, [torch.ones(3)], None)
    shm_err = ""
    try:
        C.all_reduce(torch.ones(2), options=C.CommunicationOptions(implementation="SHM"))
    except ValueError as e:
        shm_err = str(e)
    return {"fails": fails, "auto": chosen.name, "hosts": topology.group_hosts(None), "shm_err": shm_err}


def timeout_absent_peer(rank: int, world: int, impl: str) -> str:
    """Rank 1 never joins; rank 0 must raise DeadlineExceededError naming rank 1 (``RING-async``: from the
    ``torch.futures.Future`` that ``all_reduce_async`` returns, on ``wait()``)."""
    from torchstrategies import collectives as C
    from torchstrategies.errors import DeadlineExceededError

    is_async = impl.endswith("-async")
    impl = impl.removesuffix("-async")
    g = dist.new_group(list(range(world)))  # a group per case: a timeout breaks the group it happens on
    opts = C.CommunicationOptions(implementation=impl, timeout_seconds=2)
    C.all_reduce(torch.ones(1), group=g, options=opts)  # set up first, so the timeout hits the all-reduce
    if rank == 1:
        time.sleep(5)
        return "absent"
    t0 = time.monotonic()
    try:
        if is_async:
            fut = C.all_reduce_async(torch.ones(10), group=g, options=opts)
            if not isinstance(fut, torch.futures.Future):
                return f"not a torch.futures.Future: {type(fut).__name__}"
            fut.wait()
        else:
            C.all_reduce(torch.ones(10), group=g, options=opts)
    except DeadlineExceededError as e:
        return f"raised after {time.monotonic() - t0:.1f}s: {e}"
    return "no error"


def dead_peer(rank: int, world: int) -> str:
    """Rank 1 SIGKILLs itself mid-run; the others must raise UnavailableError naming it, not hang."""
    from torchstrategies import collectives as C
    from torchstrategies.errors import UnavailableError

    opts = C.CommunicationOptions(implementation="SHM", timeout_seconds=60)
    C.all_reduce(torch.ones(100), options=opts)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        C.all_reduce(torch.ones(100), options=opts)
    except UnavailableError as e:
        msg = str(e)
        try:
            C.all_reduce(torch.ones(100), options=opts)
        except RuntimeError as e2:  # peers raise fast after a group has failed
            msg += f" || again: {type(e2).__name__}"
        return msg
    return "no error"


def debug_mismatch(rank: int, world: int) -> str:
    """Debug mode (read when a group is first used) compares the shapes before the call."""
    from torchstrategies import collectives as C

    g = dist.new_group(list(range(world)))
    x = torch.ones(3 + rank)
    try:
        C.all_reduce(x, group=g, options=C.CommunicationOptions(implementation="RING", timeout_seconds=30))
    except ValueError as e:
        return str(e)
    return "no error"


def shm_many(rank: int, world: int) -> list[str]:
    """SHM reduces a list in place as one concatenated buffer (no packing): pieces of every size (0 too)
    under the one-shot limit, across it, and across the staging-slot chunk boundaries; against gloo."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationOptions

    opts = CommunicationOptions(implementation="SHM", timeout_seconds=60)
    from torchstrategies.collectives.backend import shm_slot_bytes

    per_slot = shm_slot_bytes() // 8  # float64 elements per chunk
    cases = [
        [0, 1, 7, 0, 4097],                                    # 16 KiB in all: the one-shot path
        [1000, 0, 20000, 3, 50001],                            # chunked, one chunk, pieces split by slices
        [per_slot - 5, 11, 0, per_slot + 7, 3],                # pieces straddle chunk and slice boundaries
    ]
    fails = []
    for k, sizes in enumerate(cases):
        for dname, op in (("float64", "SUM"), ("float32", "MEAN"), ("int64", "MAX"), ("bfloat16", "MIN")):
            dtype = DTYPES[dname]
            xs = [make(rank, n, dtype, 50 + 10 * k + i) for i, n in enumerate(sizes)]
            ys = [x.clone() for x in xs]
            C.all_reduce_(ys, op=op, options=opts)
            for i, (x, y) in enumerate(zip(xs, ys)):
                ref = reference(x, op, world)
                atol, rtol = tol(dtype, world)
                if not torch.allclose(y.to(ref.dtype), ref.to(dtype).to(ref.dtype), atol=atol, rtol=rtol):
                    fails.append(f"many case {k} {dname} {op} piece {i} (n={sizes[i]}): wrong values")
            flat = torch.cat([y.reshape(-1) for y in ys]).view(torch.uint8) if sum(sizes) else torch.empty(0)
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            if any(not torch.equal(g, flat) for g in gathered):
                fails.append(f"many case {k} {dname} {op}: ranks disagree")
    return fails


def shm_many_aliased(rank: int, world: int) -> bool:
    """A list holding one tensor twice and a view of it: every entry ends with the sum of its own values
    (each reduced once, as with packing), not a doubly reduced one."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationOptions

    t = torch.arange(200_000, dtype=torch.float64) * (rank + 1)  # 1.6 MB: the chunked path
    expected = torch.arange(200_000, dtype=torch.float64) * sum(r + 1 for r in range(world))
    opts = CommunicationOptions(implementation="SHM", timeout_seconds=60)
    C.all_reduce_([t, t[1000:5000], t], options=opts)
    return bool(torch.equal(t, expected))


def shm_many_mismatch(rank: int, world: int) -> str:
    """Lists of the same total size but different pieces on different ranks: an error, not a silent
    pairing."""
    from torchstrategies import collectives as C

    parts = [torch.ones(6)] if rank == 0 else [torch.ones(2), torch.ones(4)]
    try:
        C.all_reduce_(parts, options=C.CommunicationOptions(implementation="SHM", timeout_seconds=30))
    except ValueError as e:
        return str(e)
    return "no error"


def shm_mismatch(rank: int, world: int) -> str:
    from torchstrategies import collectives as C

    x = torch.ones(3 + rank)
    try:
        C.all_reduce(x, options=C.CommunicationOptions(implementation="SHM", timeout_seconds=30))
    except ValueError as e:
        return str(e)
    return "no error"


def bad_input(rank: int, world: int) -> list[str]:
    from torchstrategies import collectives as C

    msgs = []
    for call in (
        lambda: C.all_reduce(torch.ones(3, dtype=torch.int64), op="mean"),
        lambda: C.all_reduce(torch.ones(3), options=C.CommunicationOptions(implementation="TREE")),
        lambda: C.all_reduce([torch.ones(2), "x"]),
        lambda: C.all_reduce(torch.ones(2), op="prod"),
        lambda: C.all_reduce(torch.ones(2), options=C.CommunicationOptions(implementation="NCCL")),
        lambda: C.broadcast(torch.ones(2), src=world),
    ):
        try:
            call()
            msgs.append("no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def fast_path_cache(rank: int, world: int) -> dict:
    """Repeated calls with one options object give fresh results; options mutated after use are followed."""
    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationImplementation, CommunicationOptions

    opts = CommunicationOptions(implementation="SHM", timeout_seconds=30)
    sums = []
    for step in range(5):  # fresh values each call
        t = torch.full((1000,), float(rank + 1 + step))
        C.all_reduce_(t, op="sum", options=opts)
        sums.append(t[0].item())
    opts.implementation = CommunicationImplementation.GLOO  # mutate after use: the next call follows it
    t = torch.full((1000,), float(rank + 1))
    C.all_reduce_(t, op="sum", options=opts)
    return {"sums": sums, "after": t[0].item(), "chosen": C.choose(opts.implementation, [t], None).name}


def group_lifetime(rank: int, world: int, store_path: str) -> dict:
    """destroy_process_group frees the group at once (no cache of ours keeps it alive, or its gloo threads
    outlive the interpreter and abort the process at exit), and a new group gets working SHM again."""
    import gc
    import weakref

    from torchstrategies import collectives as C
    from torchstrategies.collectives import CommunicationOptions

    shm_opts = CommunicationOptions(implementation="SHM", timeout_seconds=30)
    for _ in range(3):
        C.all_reduce_(torch.ones(1000), options=shm_opts)
    C.all_reduce_async(torch.ones(10), options=shm_opts).wait()
    hier_opts = CommunicationOptions(implementation="HIERARCHICAL", timeout_seconds=30)
    C.all_reduce_(torch.ones(10), options=hier_opts)
    C.all_gather(torch.ones(3))
    world_ref = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    freed = world_ref() is None
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    t = torch.full((1000,), float(rank + 1))
    C.all_reduce_(t, options=shm_opts)  # the old group's backend must not be used
    C.all_reduce_(t, options=shm_opts)
    return {"freed": freed, "after": t[0].item()}


def suite2(rank: int, world: int, matrix_args: tuple, store_path: str = "") -> dict:
    """One 2-rank run for many checks (spawning ranks is the slow part on a 2-core machine)."""
    out: dict = {}
    out["matrix"] = matrix(rank, world, *matrix_args)
    out["packing"] = packing(rank, world, ["SHM", "RING", "GLOO"])
    out["async"] = async_and_buffers(rank, world)
    out["bad_input"] = bad_input(rank, world)
    out["fast_path"] = fast_path_cache(rank, world)
    os.environ["TORCHSTRATEGIES_DEBUG"] = "1"
    try:
        out["debug"] = debug_mismatch(rank, world)
    finally:
        del os.environ["TORCHSTRATEGIES_DEBUG"]
    out["many"] = shm_many(rank, world)
    if store_path:  # destroys the world group and makes a new one (the checks below run on it)
        out["lifetime"] = group_lifetime(rank, world, store_path)
    out["shm_mismatch"] = shm_mismatch(rank, world)
    out["after_mismatch"] = shm_after(rank)  # a mismatch does not retire the group

    return out


def shm_after(rank: int) -> float:
    from torchstrategies import collectives as C

    t = torch.full((4,), float(rank + 1))
    C.all_reduce_(t, options=C.CommunicationOptions(implementation="SHM", timeout_seconds=30))
    return t[0].item()


def many_and_mismatch(rank: int, world: int) -> dict:
    return {"many": shm_many(rank, world), "aliased": shm_many_aliased(rank, world),
            "mismatch": shm_many_mismatch(rank, world)}


def absent_peer_both(rank: int, world: int) -> dict:
    return {impl: timeout_absent_peer(rank, world, impl) for impl in ("SHM", "RING", "RING-async")}
