"""Rank bodies for tests/test_backend_shapes.py (issue 47): calls that differ only in shape, and reductions of
dtypes or ops that no implementation takes, on the "torchstrategies" backend."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _backend_bodies import _plan, group


def _shape_pairs(world: int) -> dict:
    """name: (the others' call, the odd rank's call); each pair has the same numel and dtype everywhere."""
    def ag_tensor(shape):
        return lambda g: dist.all_gather_into_tensor(torch.empty((world * shape[0],) + shape[1:]), torch.ones(shape),
                                                     group=g)

    def ag_list(shape):
        return lambda g: dist.all_gather([torch.empty(shape) for _ in range(world)], torch.ones(shape), group=g)

    def rs(shape):
        return lambda g: dist.reduce_scatter_tensor(torch.empty(shape), torch.ones((world * shape[0],) + shape[1:]),
                                                    group=g)

    def bc(shape):
        return lambda g: dist.broadcast(torch.ones(shape), src=0, group=g)

    def ar(shape):
        return lambda g: dist.all_reduce(torch.ones(shape), group=g)

    return {
        "all_gather_into_tensor (12,) vs (3, 4)": (ag_tensor((12,)), ag_tensor((3, 4))),
        "all_gather list (12,) vs (3, 4)": (ag_list((12,)), ag_list((3, 4))),
        "all_gather list vs all_gather_into_tensor": (ag_list((12,)), ag_tensor((12,))),
        "reduce_scatter_tensor (12,) vs (3, 4)": (rs((12,)), rs((3, 4))),
        "broadcast (12,) vs (3, 4)": (bc((12,)), bc((3, 4))),
        "all_reduce (12,) vs (3, 4)": (ar((12,)), ar((3, 4))),
    }


def _after(g, rank: int, world: int) -> bool:
    """The next calls give the right results (native float32 and int8 through gloo)."""
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, group=g)
    y = torch.full((5,), rank + 1, dtype=torch.int8)
    dist.all_reduce(y, group=g)
    total = world * (world + 1) // 2
    return x.tolist() == [float(total)] * 3 and y.tolist() == [total] * 5


def shape_pairs(rank: int, world: int, impl: str) -> dict:
    """Every pair of ``_shape_pairs`` with rank 1 and the last rank as the odd one: what it raised here, and
    whether the next calls were right; and the same calls made alike by every rank (they must work)."""
    g = group(impl, timeout=30.0)
    out: dict = {"plan": _plan(g)}
    for odd in sorted({1, world - 1}):
        for name, (common, different) in _shape_pairs(world).items():
            try:
                (different if rank == odd else common)(g)
                raised = ""
            except Exception as e:  # noqa: BLE001 - reported
                raised = f"{type(e).__name__}: {e}"
            out[f"{name} (odd rank {odd})"] = (raised, _after(g, rank, world))
    alike = []
    for name, (common, different) in _shape_pairs(world).items():
        for call in (common, different):
            try:
                call(g)
            except Exception as e:  # noqa: BLE001 - reported
                alike.append(f"{name}: {type(e).__name__}: {e}")
    grid = [torch.empty(3, 4) for _ in range(world)]
    dist.all_gather(grid, torch.full((3, 4), float(rank)), group=g)
    if [t[1, 2].item() for t in grid] != [float(r) for r in range(world)]:
        alike.append("all_gather (3, 4) gave wrong values")
    out["alike"] = alike
    return out


UNSUPPORTED = [  # (collective, dtype, op)
    ("all_reduce", torch.int16, "SUM"), ("all_reduce", torch.int16, "MAX"), ("all_reduce", torch.int8, "AVG"),
    ("all_reduce", torch.uint8, "AVG"), ("all_reduce", torch.bool, "AVG"), ("all_reduce", torch.int32, "AVG"),
    ("all_reduce", torch.int64, "AVG"), ("all_reduce", torch.float32, "BAND"), ("all_reduce", torch.float64, "BXOR"),
    ("reduce_scatter", torch.int16, "SUM"), ("reduce_scatter", torch.int8, "AVG"),
    ("reduce_scatter", torch.int32, "AVG"),
    ("reduce", torch.int16, "SUM"), ("reduce", torch.uint8, "AVG"),
]


def _call(what: str, dtype: torch.dtype, op: str, world: int, g) -> None:
    o = getattr(dist.ReduceOp, op)
    if what == "all_reduce":
        dist.all_reduce(torch.ones(4, dtype=dtype), op=o, group=g)
    elif what == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(2, dtype=dtype), torch.ones(2 * world, dtype=dtype), op=o, group=g)
    else:
        dist.reduce(torch.ones(4, dtype=dtype), dst=0, op=o, group=g)


def unsupported(rank: int, world: int, impl: str) -> dict:
    """Each UNSUPPORTED call made by every rank: what it raised here, and whether the next calls were right."""
    g = group(impl, timeout=30.0)
    out: dict = {}
    for what, dtype, op in UNSUPPORTED:
        try:
            _call(what, dtype, op, world, g)
            raised = ""
        except Exception as e:  # noqa: BLE001 - reported
            raised = f"{type(e).__name__}: {e}"
        out[f"{what} {str(dtype).replace('torch.', '')} {op}"] = (raised, _after(g, rank, world))
    # one rank makes an unsupported call, the others a supported one: the mismatch, on every rank
    try:
        _call("all_reduce", torch.int16 if rank == world - 1 else torch.int32, "SUM", world, g)
        raised = ""
    except Exception as e:  # noqa: BLE001 - reported
        raised = f"{type(e).__name__}: {e}"
    out["mismatch"] = (raised, _after(g, rank, world))
    return out
