"""Rank bodies for tests/test_backend*.py (top-level so spawn can pickle them): the "torchstrategies"
torch.distributed backend used through torch.distributed itself."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
       "PRODUCT": dist.ReduceOp.PRODUCT}


def group(impl: str, timeout: float = 60.0, ranks: list[int] | None = None):
    import torchstrategies  # noqa: F401 - registers the backend
    from torchstrategies.collectives import BackendOptions

    return dist.new_group(ranks, backend="torchstrategies", timeout=timedelta(seconds=timeout),
                          pg_options=BackendOptions(implementation=impl))


def _values(rank: int, n: int, dtype: torch.dtype, op: str, seed: int) -> torch.Tensor:
    """Small integers (exact in every dtype, also summed or multiplied over 3 ranks), per rank."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    lo, hi = (-2, 3) if op == "PRODUCT" else (-8, 9)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _gloo_reference(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """gloo's all-reduce of ``x`` (in float64 / int64: exact for these values); AVG as SUM / world."""
    wide = x.to(torch.float64 if x.is_floating_point() else torch.int64, copy=True)
    dist.all_reduce(wide, op=OPS["SUM" if op == "AVG" else op])
    if op == "AVG":
        wide = wide / world
    return wide.to(x.dtype)


def _same(a: torch.Tensor, b: torch.Tensor, op: str = "SUM") -> bool:
    """Equal bits; for AVG (SUM times 1/world in the accumulation type, gloo has no AVG) within a rounding."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if op == "AVG":
        eps = torch.finfo(a.dtype).eps
        return torch.allclose(a.double(), b.double(), rtol=2 * eps, atol=0)
    return torch.equal(a, b)


def native_matrix(rank: int, world: int, impl: str, sizes: list[int]) -> list[str]:
    """Every native collective on the backend against gloo (the world group), every dtype and op."""
    g = group(impl)
    fails: list[str] = []
    for k, (dtype, op, n) in enumerate([(d, o, n) for d in DTYPES for o in OPS for n in sizes]):
        if op == "AVG" and not dtype.is_floating_point:
            continue
        x = _values(rank, n, dtype, op, k)
        ref = _gloo_reference(x, op, world)
        tag = f"{dtype} {op} n={n}"
        y = x.clone()
        dist.all_reduce(y, op=OPS[op], group=g)
        if not _same(y, ref, op):
            fails.append(f"all_reduce {tag}: {y[:4].tolist()} vs {ref[:4].tolist()}")
        nc = torch.stack([x, x]).t()[:, 0]  # a non-contiguous view
        dist.all_reduce(nc, op=OPS[op], group=g)
        if not _same(nc, ref, op):
            fails.append(f"all_reduce non-contiguous {tag}")
        parts = [x.clone(), (x * 0 + 1).to(dtype)[: max(1, n // 2)]]
        refs = [ref, _gloo_reference(parts[1].clone(), op, world)]
        dist.all_reduce_coalesced(parts, op=OPS[op], group=g)
        if not all(_same(p, r, op) for p, r in zip(parts, refs)):
            fails.append(f"all_reduce_coalesced {tag}")
        full = torch.cat([x + i for i in range(world)]) if op != "PRODUCT" else torch.cat([x] * world)
        full_ref = _gloo_reference(full.clone(), op, world)
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, full, op=OPS[op], group=g)
        if not _same(out, full_ref[rank * n:(rank + 1) * n], op):
            fails.append(f"reduce_scatter_tensor {tag}")
        out2 = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out2, list(full.chunk(world)) if n else [torch.empty(0, dtype=dtype)] * world,
                            op=OPS[op], group=g)
        if not _same(out2, out):
            fails.append(f"reduce_scatter (list) {tag}")
        if op == "SUM":  # the byte-moving collectives, once per dtype and size
            mine = [torch.empty_like(x) for _ in range(world)]
            theirs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(mine, x, group=g)
            dist.all_gather(theirs, x)
            if not all(_same(a, b) for a, b in zip(mine, theirs)):
                fails.append(f"all_gather {tag}")
            flat = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(flat, x, group=g)
            if not _same(flat, torch.cat(theirs)):
                fails.append(f"all_gather_into_tensor {tag}")
            b = x.clone()
            dist.broadcast(b, src=world - 1, group=g)
            if not _same(b, theirs[world - 1]):
                fails.append(f"broadcast {tag}")
    dist.barrier(group=g)
    # A dtype our kernels do not take goes to gloo inside the backend, with the same result.
    flags = torch.tensor([rank % 2 == 0, True, False])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=g)
    if flags.tolist() != [True, True, False]:
        fails.append(f"bool all_reduce through gloo: {flags.tolist()}")
    return fails


def delegated(rank: int, world: int, impl: str) -> dict:
    """What the backend hands to gloo: all_to_all (uneven), gather, scatter, reduce, send/recv, objects."""
    g = group(impl)
    out: dict = {}
    sizes = [r + 1 for r in range(world)]  # rank r receives r + 1 elements from every rank
    inp = torch.cat([torch.full((sizes[j],), float(rank * 10 + j)) for j in range(world)])
    res = torch.empty(world * (rank + 1))
    dist.all_to_all_single(res, inp, output_split_sizes=[rank + 1] * world, input_split_sizes=sizes, group=g)
    out["all_to_all"] = res.tolist() == [float(j * 10 + rank) for j in range(world) for _ in range(rank + 1)]
    lst = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(lst, [torch.full((2,), float(rank * 10 + j)) for j in range(world)], group=g)
    out["all_to_all_list"] = [t[0].item() for t in lst] == [float(j * 10 + rank) for j in range(world)]
    gl = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gl, dst=0, group=g)
    out["gather"] = rank != 0 or [t.item() for t in gl] == [float(r) for r in range(world)]
    sc = torch.empty(1)
    dist.scatter(sc, [torch.tensor([float(r * 2)]) for r in range(world)] if rank == 0 else None, src=0, group=g)
    out["scatter"] = sc.item() == float(rank * 2)
    red = torch.tensor([float(rank + 1)])
    dist.reduce(red, dst=0, group=g)
    out["reduce"] = rank != 0 or red.item() == float(world * (world + 1) // 2)
    if rank in (0, 1):
        t = torch.tensor([float(rank)])
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1, group=g)
        else:
            dist.recv(t, src=0, group=g)
        out["send_recv"] = rank == 0 or t.item() == 42.0
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=g)
    out["all_gather_object"] = objs == [{"rank": r} for r in range(world)]
    blist = [f"from {rank}"]
    dist.broadcast_object_list(blist, src=0, group=g)
    out["broadcast_object_list"] = blist == ["from 0"]
    return out


def ddp_matches_gloo(rank: int, world: int, impl: str) -> dict:
    """DDP on the backend trains bitwise like DDP on gloo (float64, 5 steps)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(process_group) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()
        ddp = DDP(model, process_group=process_group, bucket_cap_mb=0.001)  # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(5):
            x = torch.randn(8, 20, generator=gen, dtype=torch.float64)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ours = train(group(impl))
    gloo = train(None)
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(ours, gloo)),
            "moved": not torch.equal(ours[0], _initial_first_weight())}


def _initial_first_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(20, 32).double().weight.detach()


def fsdp2_matches_ddp(rank: int, world: int) -> dict:
    """FSDP2 fully_shard on CPU over the backend (the default group) trains like DDP on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchstrategies  # noqa: F401

    dist.init_process_group("torchstrategies", rank=rank, world_size=world, timeout=timedelta(seconds=60))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)).double()

    def run(m: torch.nn.Module) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(5):
            x = torch.randn(6, 16, generator=gen, dtype=torch.float64)
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    ddp_model = model()
    run(DDP(ddp_model))
    mesh = init_device_mesh("cpu", (world,))
    sharded = model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    run(sharded)
    full = [p.full_tensor() for p in sharded.parameters()]
    ref = list(ddp_model.parameters())
    out = {"backend": dist.get_backend(), "close": all(torch.allclose(a, b, rtol=1e-10, atol=1e-12)
                                                       for a, b in zip(full, ref))}
    dist.destroy_process_group()
    return out


def peer_dies_or_freezes(rank: int, world: int, impl: str, how: str, victim: int, timeout: float,
                         tmp: str = "") -> tuple:
    """``victim`` is SIGKILLed or SIGSTOPped after a first all-reduce; the others report what
    ``dist.all_reduce`` on the backend raised and how long it took. With SIGSTOP the first survivor then
    kills the victim once every survivor has its error (files in ``tmp``: the store may be the victim's)."""
    g = group(impl, timeout=timeout)
    dist.all_reduce(torch.ones(100), group=g)  # set up while everyone is alive
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(120)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100), group=g)
        result: tuple = ("no error", "", 0.0)
    except dist.DistBackendError as e:
        result = ("DistBackendError", str(e), time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - reported
        result = (type(e).__name__, str(e), time.monotonic() - t0)
    # Every survivor stays until all have their error (an exit looks like a death to a slower one).
    open(os.path.join(tmp, f"done{rank}"), "w").close()
    survivors = [r for r in range(world) if r != victim]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(tmp, f"done{r}")) for r in survivors):
        time.sleep(0.05)
    if how == "stop" and rank == survivors[0]:
        os.kill(pids[victim], signal.SIGKILL)
    return result


def group_timeouts(rank: int, world: int) -> dict:
    """The timeout the collectives read for groups on the backend: a group's own, and the world's for a new
    group made without one (``collectives.new_group``)."""
    import torchstrategies as ts
    from torchstrategies import collectives
    from torchstrategies.collectives import topology

    dist.init_process_group("torchstrategies", timeout=timedelta(seconds=23))
    g = group("SHM", timeout=17.0)
    made = collectives.new_group(ts.CommunicationOptions())  # no timeout_seconds: the world's
    out = {"world": topology.group_timeout(None), "group": topology.group_timeout(g),
           "new_group": topology.group_timeout(made)}
    dist.destroy_process_group()
    return out


def _mismatch_pairs(world: int) -> dict:
    """Each pair: what the odd rank calls and what the others call, on the group ``g`` (issue 38)."""
    def ar(dtype, op, n=4):
        return lambda g: dist.all_reduce(torch.ones(n, dtype=dtype), op=OPS.get(op) or getattr(dist.ReduceOp, op),
                                         group=g)

    def rs(dtype, op):
        return lambda g: dist.reduce_scatter_tensor(torch.empty(2, dtype=dtype), torch.ones(2 * world, dtype=dtype),
                                                    op=getattr(dist.ReduceOp, op), group=g)

    def bc(dtype, n):
        return lambda g: dist.broadcast(torch.ones(n, dtype=dtype), src=0, group=g)

    def ag(dtype, n):
        return lambda g: dist.all_gather_into_tensor(torch.empty(world * n, dtype=dtype), torch.ones(n, dtype=dtype),
                                                     group=g)

    def coalesced(g):
        dist.all_reduce_coalesced([torch.ones(4), torch.ones(4)], group=g)

    def gather_two(g):  # one allgather_into_tensor_coalesced call of two pairs
        with dist._coalescing_manager(group=g):
            for _ in range(2):
                dist.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4), group=g)

    return {  # name: (the others' call, the odd rank's call)
        "int8 SUM vs MAX": (ar(torch.int8, "SUM"), ar(torch.int8, "MAX")),
        "uint8 BAND vs BOR": (ar(torch.uint8, "BAND"), ar(torch.uint8, "BOR")),
        "int8 vs uint8": (ar(torch.int8, "SUM"), ar(torch.uint8, "SUM")),
        "bool vs int8": (ar(torch.bool, "MAX"), ar(torch.int8, "MAX")),
        "int16 x4 vs int8 x8": (ar(torch.int16, "SUM", 4), ar(torch.int8, "SUM", 8)),
        "float32 SUM vs AVG": (ar(torch.float32, "SUM"), ar(torch.float32, "AVG")),
        "float32 vs int8": (ar(torch.float32, "SUM"), ar(torch.int8, "SUM")),
        "list vs single": (coalesced, ar(torch.float32, "SUM", 8)),
        "reduce_scatter int8 SUM vs MAX": (rs(torch.int8, "SUM"), rs(torch.int8, "MAX")),
        "reduce_scatter float32 SUM vs MAX": (rs(torch.float32, "SUM"), rs(torch.float32, "MAX")),
        "broadcast int16 x4 vs int8 x8": (bc(torch.int16, 4), bc(torch.int8, 8)),
        "all_gather int16 x4 vs int8 x8": (ag(torch.int16, 4), ag(torch.int8, 8)),
        "all_gather two coalesced vs one": (gather_two, ag(torch.float32, 8)),
        "reduce int8 SUM vs MAX": (lambda g: dist.reduce(torch.ones(4, dtype=torch.int8), dst=0, group=g),
                                   lambda g: dist.reduce(torch.ones(4, dtype=torch.int8), dst=0,
                                                         op=dist.ReduceOp.MAX, group=g)),
    }


def mismatch_pairs(rank: int, world: int, impl: str) -> dict:
    """Every pair of ``_mismatch_pairs``, with the last rank and then rank 1 as the odd one: what each call
    raised on this rank ("" if nothing), and whether the next calls (native float32, and int8 through gloo)
    gave the right sums."""
    g = group(impl, timeout=30.0)
    out: dict = {"plan": _plan(g)}
    for odd in sorted({1, world - 1}):
        for name, (common, different) in _mismatch_pairs(world).items():
            try:
                (different if rank == odd else common)(g)
                raised = ""
            except Exception as e:  # noqa: BLE001 - reported
                raised = f"{type(e).__name__}: {e}"
            x = torch.full((3,), float(rank + 1))
            dist.all_reduce(x, group=g)
            y = torch.full((5,), rank + 1, dtype=torch.int8)
            dist.all_reduce(y, group=g)
            total = world * (world + 1) // 2
            out[f"{name} (odd rank {odd})"] = (raised, x.tolist() == [float(total)] * 3 and y.tolist() == [total] * 5)
    return out


def _plan(g) -> str:
    from torchstrategies._ext import _C

    return str(_C.backend_plan(g._get_backend(torch.device("cpu")))[0])


def collectives_into_strided_outputs(rank: int, world: int, impl: str) -> list:
    """all_gather into non-contiguous output tensors (transposed views of every other element of a larger
    tensor), all_gather_into_tensor and reduce_scatter_tensor into every other element: the values land where
    the views point, and nothing else is written."""
    g = group(impl)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    bases = [torch.zeros(3, 2, 2) for _ in range(world)]
    outs = [b[:, :, 0].t() for b in bases]  # shape (2, 3), strides (2, 4)
    dist.all_gather(outs, x, group=g)
    flat_base = torch.zeros(world * 6 * 2)
    flat = flat_base[::2]
    dist.all_gather_into_tensor(flat, x.reshape(-1), group=g)
    ok = all(torch.equal(o, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r) for r, o in enumerate(outs))
    ok_flat = torch.equal(flat, torch.cat([torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)]))
    rs_base = torch.zeros(6)
    dist.reduce_scatter_tensor(rs_base[::2], torch.arange(3 * world, dtype=torch.float32), group=g)
    ok_rs = rs_base[::2].tolist() == [float(world * (3 * rank + i)) for i in range(3)]
    untouched = (all(torch.equal(b[:, :, 1], torch.zeros(3, 2)) for b in bases) and not flat_base[1::2].any()
                 and not rs_base[1::2].any())
    return [ok, ok_flat, ok_rs, untouched]


def profiler_spans(rank: int, world: int, impl: str) -> dict:
    """The backend's calls under torch.profiler: every collective is a "torchstrategies:<op>" span with its
    tensors' sizes, the calls the worker thread runs (async_op=True) too."""
    from torch.profiler import ProfilerActivity, profile

    g = group(impl)
    dist.all_reduce(torch.ones(8), group=g)  # set-up outside the profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(torch.ones(1024), group=g)
        dist.all_reduce(torch.ones(4, dtype=torch.int8), group=g)  # handed to gloo
        w = dist.all_reduce(torch.ones(16, 2), group=g, async_op=True)
        w.wait()
        dist.broadcast(torch.ones(7), src=0, group=g)
        dist.barrier(group=g)
    spans: dict = {}
    for e in prof.events():
        if e.name.startswith("torchstrategies:"):
            spans.setdefault(e.name, []).append([list(s) for s in e.input_shapes])
    return spans


def set_timeout_while_calls_run(rank: int, world: int) -> list:
    """``ProcessGroup.set_timeout`` from one thread while another thread's calls read the timeout: the backend
    reports the last one set, and every call completes."""
    import threading

    from torchstrategies._ext import _C

    g = group("SHM", timeout=30.0)
    backend = g._get_backend(torch.device("cpu"))
    stop = threading.Event()

    def setter() -> None:
        k = 0
        while not stop.is_set():
            g.set_timeout(timedelta(seconds=20 + k % 5))
            k += 1

    t = threading.Thread(target=setter)
    t.start()
    sums = []
    for _ in range(200):
        x = torch.ones(3)
        dist.all_reduce(x, group=g, async_op=True).wait()
        sums.append(x.tolist() == [float(world)] * 3)
    stop.set()
    t.join()
    g.set_timeout(timedelta(seconds=7))
    return [all(sums), _C.backend_timeout(backend)]


def futures_of_calls(rank: int, world: int, impl: str) -> dict:
    """A Work's future made before the call completes, after it completed, and of a failed call: each holds the
    call's outputs (or its error), and asking twice gives the same future."""
    g = group(impl, timeout=30.0)
    total = float(world * (world + 1) // 2)
    out: dict = {}
    x = torch.full((4,), float(rank + 1))
    w = dist.all_reduce(x, group=g, async_op=True)
    before = w.get_future()  # asked for while the call may still be queued
    got = before.wait()[0]
    out["before"] = got.tolist() == [total] * 4 and got.data_ptr() == x.data_ptr()
    y = torch.full((3,), float(rank + 1))
    w = dist.all_reduce(y, group=g, async_op=True)
    w.wait()
    after = w.get_future()  # made after the call completed
    out["after"] = after.done() and after.value()[0].tolist() == [total] * 3
    after.value()[0].add_(1)  # the same future twice: the same outputs (y itself)
    out["same"] = w.get_future().value()[0].tolist() == [total + 1] * 3 == y.tolist()
    # A failed call (rank 0 reduces int16 x4, the others int8 x8): wait() raises, and so does its future,
    # whether it was made before the call ended or after.
    bad = torch.ones(4, dtype=torch.int16) if rank == 0 else torch.ones(8, dtype=torch.int8)
    errors = []
    for early in (True, False):
        w = dist.all_reduce(bad, group=g, async_op=True)
        f = w.get_future() if early else None
        try:
            w.wait()
            errors.append("")
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}")
        try:
            (f or w.get_future()).wait()
            errors.append("")
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    z = torch.full((2,), float(rank + 1))
    dist.all_reduce(z, group=g)
    out["next"] = z.tolist() == [total] * 2
    return out
