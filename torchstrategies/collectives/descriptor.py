"""Debug mode's call descriptors: before any data moves, the ranks of a group compare what each is about to do.

A descriptor is a fixed-size int64 row (collective, sequence number in the group, reduce op, dtype,
element count, a hash of the shapes). Every rank gathers every row with one small all-gather of the same
size and dtype on every rank, so a mismatch can never reach gloo (where a size or dtype mismatch aborts the
process and an op mismatch silently gives different results). The torchstrategies backend compares its own
descriptors, shapes included, on every call in C++ (csrc/core/desc.h); this check runs with
TORCHSTRATEGIES_DEBUG=1 on any group (``debug.check``): the same rule (collective, op, dtype, shapes) for
gloo and NCCL groups, which have no descriptor of their own.

The sequence numbers are kept in the group's ``GroupState`` (a new group starts at 0) and recover after a mismatch:
every rank sees the same rows, so every rank raises, and all continue from the largest sequence seen.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from torchstrategies.collectives import topology
from torchstrategies.collectives._common import DTYPE_CODES, OP_CODES, host_hash, remember_peers, wait_work
from torchstrategies.collectives.group_state import GroupState
from torchstrategies.reduce_op import ReduceOp

__all__ = ["check"]

_MAGIC = 0x7D15C
_KNOWN_CALLS = ("all_reduce(ring)", "all_reduce(tree)", "all_reduce(hierarchical)", "debug:all_reduce",
                "debug:broadcast", "debug:all_gather")
_WHAT: dict[str, int] = {w: zlib.crc32(w.encode()) & 0x7FFFFFFF for w in _KNOWN_CALLS}
_CPU = torch.device("cpu")
_SRC_BASE = 1 << 20  # a broadcast's source rank r is sent as op code _SRC_BASE + r
_FIELDS = ("magic", "seq", "call", "op", "dtype", "numel", "shapes", "setting")
_COMPARED = len(_FIELDS)
K = TypeVar("K")


def _code(table: Mapping[K, int], key: K) -> int:
    code = table.get(key)
    if code is None:
        code = zlib.crc32(str(key).encode()) & 0x7FFFFFFF
    return code


def _name(table: Mapping[K, int], code: int) -> str:
    for k, v in table.items():
        if v == code:
            return getattr(k, "name", str(k).replace("torch.", ""))
    return f"#{code}"


def _row(what: str, seq: int, op: ReduceOp | int | None, tensors: Sequence[torch.Tensor], setting: int) -> list[int]:
    _WHAT.setdefault(what, zlib.crc32(what.encode()) & 0x7FFFFFFF)
    dtypes = {t.dtype for t in tensors}
    dtype = _code(DTYPE_CODES, next(iter(dtypes))) if len(dtypes) == 1 else (
        zlib.crc32(repr(sorted(map(str, dtypes))).encode()) & 0x7FFFFFFF)
    shapes = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()) & 0x7FFFFFFF
    opc = 0 if op is None else _SRC_BASE + op if isinstance(op, int) else 1 + _code(OP_CODES, op)  # 0: none
    return [_MAGIC, seq, _WHAT[what], opc, dtype, sum(t.numel() for t in tensors), shapes, int(setting),
            host_hash(), os.getpid()]  # the last two are not compared: they identify the rank's process


def _fmt(row: list[int]) -> str:
    what = next((k for k, v in _WHAT.items() if v == row[2]), f"#{row[2]}")
    op = "-" if not row[3] else f"src {row[3] - _SRC_BASE}" if row[3] >= _SRC_BASE else _name(OP_CODES, row[3] - 1)
    return (f"{what}#{row[1]}(op={op}, "
            f"dtype={_name(DTYPE_CODES, row[4])}, numel={row[5]}, shapes#{row[6]:x}, setting={row[7]})")


def check(what: str, op: ReduceOp | int | None, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
          timeout: float,
          setting: int = 0, hint: str = "") -> None:
    """Raises ValueError on every rank if any rank of ``group`` is making a different call.

    Args:
        what: the collective (and implementation), e.g. "all_reduce(ring)".
        op: the reduce op, or None for collectives without one (a broadcast passes its source).
        tensors: this rank's tensors.
        group: the process group (None: the world).
        timeout: bound on the exchange, in seconds (a dead or late peer raises UnavailableError /
            DeadlineExceededError naming it).
        setting: an integer that must also agree (e.g. RING's chunk bytes).
        hint: appended to the error (which setting ``setting`` is).
    """
    g = topology.resolve(group)
    state = GroupState.of(g)
    seq = state.seq
    mine = _row(what, seq, op, tensors, setting)
    n = dist.get_world_size(g)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(g) == "nccl" else _CPU
    out = torch.zeros((n, len(mine)), dtype=torch.int64, device=device)
    work = dist.all_gather(list(out.unbind(0)), torch.tensor(mine, dtype=torch.int64, device=device), group=g,
                           async_op=True)
    ranks = topology.group_ranks(g)
    me = dist.get_rank(g)
    wait_work(work, timeout, f"{what} (call check)", topology.describe_group(g), [r for i, r in enumerate(ranks)
                                                                               if i != me], g)
    full = out.cpu().tolist()
    if seq == 0:
        remember_peers(g, [(r[-2], r[-1]) for r in full])
    rows = [r[:_COMPARED] for r in full]
    if all(r == rows[0] for r in rows):
        state.seq = seq + 1
        return
    state.seq = max(r[1] for r in rows) + 1  # every rank sees the same rows: all raise, all resynchronize
    other = next(i for i, r in enumerate(rows) if r != rows[0])
    diff = [f for f, a, b in zip(_FIELDS, rows[0], rows[other]) if a != b]
    # Every rank is here, so one more fixed-size exchange can carry each call's shapes for the message.
    texts = _gather_text(_fmt(mine) + " tensors=[" + ", ".join(f"{list(t.shape)} {t.dtype}" for t in tensors)
                         + "]", g, device, timeout, what, ranks, me)
    raise ValueError(
        f"collective mismatch on {topology.describe_group(g)}: rank {ranks[0]} called {texts[0]} but "
        f"rank {ranks[other]} called {texts[other]} (differs in {', '.join(diff)}){hint}"
    )


_TEXT_BYTES = 1024


def _gather_text(text: str, g: dist.ProcessGroup, device: torch.device, timeout: float, what: str, ranks: list[int],
                 me: int) -> list[str]:
    raw = text.encode()[:_TEXT_BYTES]
    mine = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = torch.zeros((len(ranks), _TEXT_BYTES), dtype=torch.uint8, device=device)
    work = dist.all_gather(list(out.unbind(0)), mine.to(device), group=g, async_op=True)
    wait_work(work, timeout, f"{what} (call check)", topology.describe_group(g),
              [r for i, r in enumerate(ranks) if i != me], g)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out.cpu().tolist()]
