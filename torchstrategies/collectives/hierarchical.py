"""HIERARCHICAL: SHM inside each host, RING or the native all-reduce between one leader per host, SHM broadcast back.

Between leaders the C++ TCP ring runs where the shipped measurement shows it beating gloo for the message size
(``ring.preferred``), gloo elsewhere.

Host identity comes from ``topology.host_id`` (hostname, or TORCHSTRATEGIES_HOST_ID to simulate hosts).
The per-host groups and the leader group are made with ``dist.new_group`` by every rank in the same
order, so this works for the world group only (group=None); other groups raise ValueError.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.collectives import descriptor, native, ring, shm, topology
from torchstrategies.collectives._common import deadline_error, diagnose, peer_error
from torchstrategies.errors import DeadlineExceededError, UnavailableError
from torchstrategies.reduce_op import ReduceOp

__all__ = ["all_reduce_", "Layout", "layout"]


class Layout:
    """Per-host groups of the world: this rank's host group, and the leaders' group (or None)."""

    def __init__(self) -> None:
        world = dist.group.WORLD
        hosts = topology.group_hosts(world)
        order: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            order.setdefault(h, []).append(r)
        me = dist.get_rank()
        self.num_hosts = len(order)
        self.local_group: Any = None
        self.leader_group: Any = None
        for members in order.values():  # every rank creates every group, in the same order
            g = dist.new_group(members)
            if me in members:
                self.local_group = g
                self.local_ranks = members
        leaders = [m[0] for m in order.values()]
        lg = dist.new_group(leaders)
        self.is_leader = me in leaders
        if self.is_leader:
            self.leader_group = lg


# The layout of the current world group, keyed by it weakly: destroying the world (and re-initializing)
# drops the layout and its per-host groups instead of keeping dead process groups alive.
# The value is (topology generation, layout): topology.clear_caches() (new host identities) drops it too.
_layouts: weakref.WeakKeyDictionary[Any, tuple[int, Layout]] = weakref.WeakKeyDictionary()


def _leader_all_reduce(t: torch.Tensor, op: ReduceOp, group: Any, timeout: float) -> torch.Tensor:
    """Between host leaders: RING where it measured faster than gloo for this size, else gloo."""
    fn = ring.all_reduce_ if ring.preferred(t.numel() * t.element_size()) else native.all_reduce_
    return fn(t, op, group, timeout)


# The inter-host stage (a list, so tests can put a failing stand-in in its place).
LEADER_ALL_REDUCE = [_leader_all_reduce]


def layout() -> Layout:
    world = dist.group.WORLD
    entry = _layouts.get(world)
    if entry is None or entry[0] != topology.generation():
        entry = _layouts[world] = (topology.generation(), Layout())
    return entry[1]


def all_reduce_(t: torch.Tensor, op: ReduceOp, group: Any, timeout: float) -> torch.Tensor:
    """In-place hierarchical all-reduce of a contiguous CPU tensor (MEAN: the caller divides)."""
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(
            "HIERARCHICAL all-reduce supports the world group only (group=None); "
            f"got {topology.describe_group(group)}"
        )
    lay = layout()
    if lay.num_hosts > 1:  # inside one host the SHM stage checks the call itself
        descriptor.check("all_reduce(hierarchical)", op, [t], None, timeout)
    local = shm.get_communicator(lay.local_group, timeout)
    if op is ReduceOp.MEAN:  # the caller divides by the world size once, at the end
        op = ReduceOp.SUM
    local.all_reduce_(t, op, timeout)
    if lay.num_hosts > 1:
        if lay.is_leader:
            try:
                LEADER_ALL_REDUCE[0](t, op, lay.leader_group, timeout)
            except Exception as exc:
                # The host's other ranks wait in the broadcast below: fail their group now, so they raise
                # at once with the same kind of error instead of a timeout or a false mismatch.
                local.abort(isinstance(exc, DeadlineExceededError))
                raise
        try:
            local.broadcast_(t, 0, timeout)
        except (UnavailableError, DeadlineExceededError) as exc:
            if lay.is_leader:
                raise
            # The leader gave up on the inter-host stage: name the rank really at fault where we can.
            gone, stopped = diagnose(dist.group.WORLD)
            what, desc = "all_reduce(hierarchical)", topology.describe_group(None)
            if gone:
                raise peer_error(what, desc, gone, f"process gone; the host leader gave up: {exc}") from exc
            if stopped:
                raise deadline_error(what, desc, timeout, stopped, f"process stopped; {exc}") from exc
            raise
    return t
