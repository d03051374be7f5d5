"""``GroupState``: everything torchstrategies.collectives remembers about one process group.

A c10d ``ProcessGroup`` takes no Python attributes, so the state is attached to the group through one
``weakref.WeakKeyDictionary`` behind :meth:`GroupState.of`: the group's lifetime owns its state. A group
destroyed with ``dist.destroy_process_group`` goes at that moment, with its state and its gloo threads (a
state that kept its group alive until interpreter exit let a gloo worker thread free its last work item
during finalization, which aborts the process: "terminate called without an active exception"). The state
therefore never refers to its group; the functions that fill it (``topology``, ``api``, ``descriptor``,
``_common``) are given the group.

This is the lowest layer of the package: it imports nothing from the modules that use it.
"""

from __future__ import annotations

import weakref
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from torchstrategies.collectives.options import CommunicationImplementation

__all__ = ["GroupState", "Target", "C10dCollectives"]


class C10dCollectives(Protocol):
    """What a group's calls run on: a c10d ``Backend`` (gloo, ours) or a ``ProcessGroup`` (CUDA tensors).

    torch's stubs give ``ProcessGroup`` these methods but not ``Backend``, which has them at run time.
    """

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions = ..., /) -> dist.Work: ...

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions = ...,
                            /) -> dist.Work: ...

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: dist.distributed_c10d.AllgatherOptions = ..., /) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions = ..., /) -> dist.Work: ...


class Target:
    """Where a group's calls for one implementation run: ``obj`` takes c10d calls (a Backend, or the group
    itself for CUDA tensors); ``ours`` says it is the torchstrategies backend, ``avg`` whether it computes
    ReduceOp.AVG (gloo does not), ``debug`` whether every call checks its descriptor. ``generation`` is
    :meth:`GroupState.generation` when it was made: ``clear_caches`` (new host identities) retires it."""

    __slots__ = ("obj", "ours", "avg", "debug", "generation")

    def __init__(self, obj: C10dCollectives, ours: bool, avg: bool, debug_on: bool) -> None:
        self.obj, self.ours, self.avg, self.debug = obj, ours, avg, debug_on
        self.generation = GroupState.generation()


class GroupState:
    """What the collectives know about one process group, kept for the group's lifetime.

    Facts that never change for a group, asked on the hot path (filled on first use by ``topology``):
        ranks: global ranks in group-rank order.
        hosts: host identity of every rank (a collective the first time).
        description: ``"world (global ranks [...])"`` / ``"group 'name' (...)"`` for error messages.
        timeout: the group's timeout in seconds.
    Learnt from the group's traffic:
        peers: every rank's (host hash, pid), from the first call check (``_common.agree_on_first_use``,
            ``descriptor.check``), so a failure names the rank really gone or stopped on this host.
        seq: debug mode's call sequence number (``descriptor.check``; a new group starts at 0).
        targets: (implementation, cuda) -> the ``Target`` its calls run on, or the exception its set-up
            raised (a set-up is attempted once per group: the ranks cannot disagree on a count).

    :meth:`clear_caches` forgets the facts of every group and bumps :meth:`generation`, which retires the
    targets made before (peers and seq describe processes and calls, not hosts: they stay).
    """

    __slots__ = ("ranks", "hosts", "description", "timeout", "peers", "seq", "targets", "__weakref__")

    _of: ClassVar[weakref.WeakKeyDictionary[dist.ProcessGroup, GroupState]] = weakref.WeakKeyDictionary()
    _generation: ClassVar[int] = 0

    def __init__(self) -> None:
        self.ranks: list[int] | None = None
        self.hosts: list[str] | None = None
        self.description: str | None = None
        self.timeout: float | None = None
        self.peers: list[tuple[int, int]] | None = None
        self.seq = 0
        self.targets: dict[tuple[CommunicationImplementation, bool], Target | BaseException] = {}

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> GroupState:
        """The state of ``group`` (made empty the first time; it goes when the group goes)."""
        state = cls._of.get(group)
        if state is None:
            state = cls._of[group] = cls()
        return state

    @classmethod
    def generation(cls) -> int:
        """The number of :meth:`clear_caches` calls so far."""
        return cls._generation

    @classmethod
    def clear_caches(cls) -> None:
        """Forgets the host-derived facts of every live group and retires every target made from them."""
        for state in list(cls._of.values()):
            state.ranks = state.hosts = state.description = None
            state.timeout = None
        cls._generation += 1
