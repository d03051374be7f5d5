"""Debug mode (TORCHSTRATEGIES_DEBUG=1): every collective, GLOO and NCCL too, checks its call descriptor.

The check is ``descriptor.check`` (collective, sequence number in the group, reduce op, dtype, sizes);
a mismatch raises ValueError on every rank naming both ranks' calls, instead of a hang, a crash in gloo
or a silently wrong result. The sequence number is kept in the group's ``GroupState`` and recovers after a
mismatch.

``agree_on_first_use`` makes the ranks of a gloo / NCCL group agree on the mode before their first call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchstrategies.collectives import descriptor, topology
from torchstrategies.collectives._common import host_hash, remember_peers, wait_work
from torchstrategies.reduce_op import ReduceOp

__all__ = ["enabled", "check", "agree_on_first_use"]

_ENV = "TORCHSTRATEGIES_DEBUG"


def enabled() -> bool:
    """True if TORCHSTRATEGIES_DEBUG is set to something other than "", "0" or "false" (read when a group
    is first used, not per call)."""
    return os.environ.get(_ENV, "") not in ("", "0", "false", "False")


def check(what: str, op: ReduceOp | int | None, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
          timeout: float | None = None) -> None:
    """Raises ValueError on every rank if another rank of the group is making a different call."""
    t = topology.group_timeout(group) if timeout is None else timeout
    descriptor.check("debug:" + what, op, tensors, group, t)


def agree_on_first_use(group: dist.ProcessGroup, timeout: float | None = None) -> bool:
    """The first call on a gloo / NCCL group: every rank exchanges (TORCHSTRATEGIES_DEBUG, host, pid), within
    ``timeout`` seconds (the first call's; None: the group's).

    Debug mode adds a collective to every call, so ranks that disagree on it would pair different
    collectives (and gloo aborts the process): a difference raises ValueError on every rank instead, naming
    the variable. The pids let a later failure name the rank really at fault. Returns the agreed flag.
    """
    flag = enabled()
    n, me = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([int(flag), host_hash(), os.getpid()], dtype=torch.int64, device=device)
    out = torch.zeros((n, 3), dtype=torch.int64, device=device)
    work = dist.all_gather(list(out.unbind(0)), mine, group=group, async_op=True)
    ranks = topology.group_ranks(group)
    seconds = topology.group_timeout(group) if timeout is None else timeout
    wait_work(work, seconds, "first call (settings check)", topology.describe_group(group),
              [r for i, r in enumerate(ranks) if i != me])
    rows = out.cpu().tolist()
    remember_peers(group, [(int(r[1]), int(r[2])) for r in rows])
    if len({r[0] for r in rows}) > 1:
        values = ", ".join(f"rank {ranks[i]}: {'1' if r[0] else 'unset'}" for i, r in enumerate(rows))
        raise ValueError(f"TORCHSTRATEGIES_DEBUG differs between ranks of {topology.describe_group(group)} "
                         f"({values}); set the same value on every rank (it is read when a group is first used)")
    return flag
