"""Groups and hosts: which ranks a group holds, where they run, and the process group's timeout.

Host identity is ``TORCHSTRATEGIES_HOST_ID`` if set, else the hostname, so tests can simulate several
hosts on one machine. The facts are kept in the group's ``GroupState`` (held for the group's lifetime).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from torchstrategies._ext import _C
from torchstrategies.collectives.group_state import GroupState

__all__ = ["host_id", "resolve", "clear_caches", "generation", "group_ranks", "group_hosts", "describe_group",
           "group_timeout"]

_CPU = torch.device("cpu")


def host_id() -> str:
    """This process's host identity: TORCHSTRATEGIES_HOST_ID, else the hostname."""
    return os.environ.get("TORCHSTRATEGIES_HOST_ID") or socket.gethostname()


def resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group object that ``group`` names (None is the world); raises if dist is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torchstrategies.collectives needs torch.distributed initialized "
            "(dist.init_process_group, e.g. under torchrun)"
        )
    if group is not None:
        return group
    world = dist.group.WORLD
    assert world is not None  # initialized above
    return world


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of the group, in group-rank order."""
    g = resolve(group)
    state = GroupState.of(g)
    if state.ranks is None:
        state.ranks = [dist.get_global_rank(g, i) for i in range(dist.get_world_size(g))]
    return state.ranks


def generation() -> int:
    """The number of clear_caches calls so far: what other modules derived from the group facts (the API's
    targets, the hierarchical layout) records the generation it was made in and is dropped when it changes."""
    return GroupState.generation()


def clear_caches() -> None:
    """Forgets every cached group fact, and every choice made from them (the state of a destroyed group
    goes by itself). Host identity is read once per group: call this after changing
    TORCHSTRATEGIES_HOST_ID in a running process (tests that simulate hosts do)."""
    GroupState.clear_caches()


def describe_group(group: dist.ProcessGroup | None) -> str:
    g = resolve(group)
    state = GroupState.of(g)
    if state.description is None:
        name = "world" if g is dist.group.WORLD else f"group '{getattr(g, 'group_name', '?')}'"
        state.description = f"{name} (global ranks {group_ranks(g)})"
    return state.description


def group_hosts(group: dist.ProcessGroup | None) -> list[str]:
    """Host identity of every rank of the group (a collective the first time per group; cached)."""
    g = resolve(group)
    state = GroupState.of(g)
    if state.hosts is None:
        out: list[object] = [None] * dist.get_world_size(g)
        dist.all_gather_object(out, host_id(), group=g)
        state.hosts = [str(h) for h in out]
    return state.hosts


def group_timeout(group: dist.ProcessGroup | None) -> float:
    """The process group's timeout in seconds (torch's default if it cannot be read)."""
    g = resolve(group)
    state = GroupState.of(g)
    if state.timeout is None:
        state.timeout = _read_timeout(g)
    return state.timeout


def _ours_timeout(g: dist.ProcessGroup) -> timedelta | None:
    b = g._get_backend(_CPU)
    return timedelta(seconds=_C.backend_timeout(b)) if _C.is_torchstrategies_backend(b) else None


def _read_timeout(g: dist.ProcessGroup) -> float:
    for get in (
        lambda: _ours_timeout(g),  # a group on our backend (its Python binding shows no options)
        lambda: g._get_backend(_CPU).options._timeout,
        lambda: g.options._timeout,  # type: ignore[attr-defined]  # older torch
        lambda: dist.distributed_c10d._get_default_group().options._timeout,  # type: ignore[attr-defined]
    ):
        try:
            t = get()
            if isinstance(t, timedelta):
                return t.total_seconds()
        except Exception:  # noqa: BLE001 - try the next way
            continue
    return dist.default_pg_timeout.total_seconds()
