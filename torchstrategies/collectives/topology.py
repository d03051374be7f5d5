"""Groups and hosts: which ranks a group holds, where they run, and the process group's timeout.

Host identity is ``TORCHSTRATEGIES_HOST_ID`` if set, else the hostname, so tests can simulate several
hosts on one machine.

Every cache here holds its process group weakly: a group destroyed with ``dist.destroy_process_group``
must really go (with its gloo threads) at that moment. A cache that kept it alive until interpreter exit
let a gloo worker thread free its last work item during finalization, which aborts the process
("terminate called without an active exception").
"""

from __future__ import annotations

import os
import socket
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["host_id", "resolve", "clear_caches", "generation", "group_ranks", "group_hosts", "describe_group",
           "group_timeout", "group_key"]

# Per group object (held weakly): hosts, global ranks, description and timeout never change for a group,
# and the hot path asks often.
_hosts_cache: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()
_ranks_cache: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
_desc_cache: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_timeout_cache: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def host_id() -> str:
    """This process's host identity: TORCHSTRATEGIES_HOST_ID, else the hostname."""
    return os.environ.get("TORCHSTRATEGIES_HOST_ID") or socket.gethostname()


def resolve(group: Any) -> Any:
    """The process group object that ``group`` names (None is the world); raises if dist is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torchstrategies.collectives needs torch.distributed initialized "
            "(dist.init_process_group, e.g. under torchrun)"
        )
    return group if group is not None else dist.group.WORLD


def group_ranks(group: Any) -> list[int]:
    """Global ranks of the group, in group-rank order."""
    g = resolve(group)
    r = _ranks_cache.get(g)
    if r is None:
        r = _ranks_cache[g] = [dist.get_global_rank(g, i) for i in range(dist.get_world_size(g))]
    return r


def group_key(group: Any) -> tuple[int, ...]:
    return tuple(group_ranks(group))


# Bumped by clear_caches: what other modules derived from these facts (the API's cached plans, the
# hierarchical layout) records the generation it was made in and is dropped when it changes.
_generation = [0]


def generation() -> int:
    """The number of clear_caches calls so far (see ``_generation``)."""
    return _generation[0]


def clear_caches() -> None:
    """Forgets every cached group fact, and every choice made from them (entries of a destroyed group also
    go by themselves). Host identity is read once per group: call this after changing
    TORCHSTRATEGIES_HOST_ID in a running process (tests that simulate hosts do)."""
    for c in (_hosts_cache, _ranks_cache, _desc_cache, _timeout_cache):
        c.clear()
    _generation[0] += 1


def describe_group(group: Any) -> str:
    g = resolve(group)
    d = _desc_cache.get(g)
    if d is None:
        d = _desc_cache[g] = _describe(g)
    return d


def _describe(g: Any) -> str:
    ranks = group_ranks(g)
    name = "world" if g is dist.group.WORLD else f"group '{getattr(g, 'group_name', '?')}'"
    return f"{name} (global ranks {ranks})"


def group_hosts(group: Any) -> list[str]:
    """Host identity of every rank of the group (a collective the first time per group; cached)."""
    g = resolve(group)
    hosts = _hosts_cache.get(g)
    if hosts is None:
        out: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(out, host_id(), group=g)
        hosts = _hosts_cache[g] = [str(h) for h in out]
    return hosts


def group_timeout(group: Any) -> float:
    """The process group's timeout in seconds (torch's default if it cannot be read)."""
    g = resolve(group)
    t = _timeout_cache.get(g)
    if t is None:
        t = _timeout_cache[g] = _read_timeout(g)
    return t


def _ours_timeout(g: Any) -> Any:
    from torchstrategies._ext import _C

    b = g._get_backend(__import__("torch").device("cpu"))
    return timedelta(seconds=_C.backend_timeout(b)) if _C.is_torchstrategies_backend(b) else None


def _read_timeout(g: Any) -> float:
    for get in (
        lambda: _ours_timeout(g),  # a group on our backend (its Python binding shows no options)
        lambda: g._get_backend(__import__("torch").device("cpu")).options._timeout,
        lambda: g.options._timeout,  # older torch
        lambda: dist.distributed_c10d._get_default_group().options._timeout,  # type: ignore[attr-defined]
    ):
        try:
            t = get()
            if isinstance(t, timedelta):
                return t.total_seconds()
        except Exception:  # noqa: BLE001 - try the next way
            continue
    return dist.default_pg_timeout.total_seconds()
