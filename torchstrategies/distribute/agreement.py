"""The agreement seam: are the replicas' (in-process) or ranks' (MultiWorkerMirrored) copies of these named
tensors equal? The one place that answers it, for the step's buffer rule, the per-step check
(``agreement_step.py``) and the checkpoint.

* The fingerprint of a tensor is :func:`fingerprints`: the exact, order-sensitive 64-bit hash of its bytes
  (``ts.ops.hash_tensors``, a C++ kernel at memory speed, CPU and CUDA alike) mixed with its dtype and shape,
  kept to 63 bits so that ``-h`` is exact.
* In-process replicas compare their components' fingerprints on the spot (:func:`check_replicas`); ranks
  compare theirs with ONE small collective, a MAX all-reduce of ``[h, -h]`` (equal on every rank exactly
  when max == -max(-h)) through the strategy's process group (:class:`RankAgreement`); the per-step check
  (``agreement_step.py``) fills its payload in C++ (``ts.ops.agreement_hash_``, the same hash with the
  tensor's dtype, shape and hashed range mixed in) and runs it after the optimizer's update
  (:meth:`RankAgreement.max_min_payload`).
  Only when something differs does a second all-reduce find which ranks hold which value, for the error.
* The one error is ``ReplicaDivergenceError``: it names the tensor, the ranks or replicas that differ, when
  (the optimizer step), and the likely cause (:func:`divergence_error`).

Example:
    >>> import torch
    >>> from torchstrategies.distribute import agreement
    >>> a = torch.arange(6.).reshape(3, 2)
    >>> b = a[[1, 0, 2]]                    # two rows swapped
    >>> f = agreement.fingerprints([a, a.clone(), b])
    >>> bool(f[0] == f[1]), bool(f[0] == f[2])
    (True, False)
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence

import torch

from torchstrategies import ops
from torchstrategies.errors import ReplicaDivergenceError
from torchstrategies.reduce_op import ReduceOp

__all__ = ["fingerprints", "fingerprint_list", "divergence_error", "check_replicas", "check_replica_piece",
           "RankAgreement", "enabled", "ENV"]

# The benchmarking knob: TORCHSTRATEGIES_AGREEMENT=0 turns the per-step agreement check off (a checkpoint
# save still checks), to measure what it costs (`torchstrategies bench train --no-agreement`). Never for
# training: a divergence then goes unnamed until the next save.
ENV = "TORCHSTRATEGIES_AGREEMENT"

_MASK63 = (1 << 63) - 1
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads the descriptor's bits


def enabled() -> bool:
    """False when ``TORCHSTRATEGIES_AGREEMENT=0`` (the benchmarking knob) switches the per-step check off."""
    return os.environ.get(ENV, "1") not in ("0", "false", "False")


def _descriptor(t: torch.Tensor) -> int:
    return zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())


def fingerprint_list(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Per tensor, the hash of its bytes mixed with its dtype and shape, in [0, 2**63) (Python ints).

    The tensors may live on several devices (each device's are hashed in one kernel call there)."""
    hashes = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, h in zip(idx, ops.hash_tensors([tensors[i] for i in idx]).tolist()):
            hashes[i] = h
    # (the low 63 bits of the int64 product and xor are those of the exact ones)
    return [(h ^ (_descriptor(t) * _GOLDEN)) & _MASK63 for h, t in zip(hashes, tensors)]


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`fingerprint_list` as an int64 CPU tensor."""
    return torch.tensor(fingerprint_list(tensors), dtype=torch.int64)


def divergence_error(tensor: str, kind: str, where: str, groups: Sequence[Sequence[int]], when: str,
                     cause: str) -> ReplicaDivergenceError:
    """The one error of the seam.

    Args:
        tensor: the tensor's name ("Linear.weight").
        kind: "parameter", "buffer", "integer buffer".
        where: "ranks" or "replicas".
        groups: the ranks (replicas) grouped by the value they hold, the group of rank (replica) 0 first.
        when: "optimizer step 3", "the checkpoint save to ...".
        cause: the likely cause and what to do.
    """
    one = where[:-1]
    base = list(groups[0]) if groups else [0]
    differ = sorted(r for g in groups[1:] for r in g)
    if differ:
        who = (f"{one} {differ[0]} holds a value that differs from {one} {base[0]}'s" if len(differ) == 1 else
               f"{where} {differ} hold values that differ from {one} {base[0]}'s")
        if len(base) > 1:
            who += f" ({where} {base} agree)"
    else:
        who = f"the {where} hold different values"
    return ReplicaDivergenceError(
        f"The {kind} {tensor} differs between the {where} at {when}: {who}, so they no longer hold the same "
        f"model. Likely cause: {cause}", tensor=tensor, replicas=differ, when=when, cause=cause)


def kind_of(t: torch.Tensor) -> str:
    if isinstance(t, torch.nn.Parameter):
        return "parameter"
    return "buffer" if (t.is_floating_point() or t.is_complex()) else "integer buffer"


def _groups(values: Sequence[int]) -> list[list[int]]:
    """Indices grouped by equal value, the group of index 0 first."""
    groups: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v, []).append(i)
    return list(groups.values())


def check_replicas(items: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], when: str,
                   name_of: Callable[[torch.Tensor], str], cause: Callable[[torch.Tensor], str]) -> None:
    """In-process: raises ``ReplicaDivergenceError`` for the first tensor whose replicas' components differ.

    Args:
        items: (the replicated tensor, its components or the same part of each: replica 0's first), on any
            devices (CPU and GPU replicas take this one path: each component is hashed where it lives).
        name_of: the tensor's name, for the message (called only then).
        cause: the likely cause of a difference in a tensor, for the message.
    """
    items = [x for x in items if len(x[1]) > 1]
    if not items:
        return
    f = fingerprint_list([c for _, comps in items for c in comps])
    off = 0
    for t, comps in items:
        values = f[off:off + len(comps)]
        off += len(comps)
        if len(set(values)) > 1:
            raise divergence_error(name_of(t), kind_of(t), "replicas", _groups(values), when, cause(t))


def check_replica_piece(items: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], piece: int, slices: int,
                        when: str, name_of: Callable[[torch.Tensor], str],
                        cause: Callable[[torch.Tensor], str]) -> None:
    """In-process, the rotating slice: raises ``ReplicaDivergenceError`` for the first tensor whose replicas'
    parts in piece ``piece`` of ``slices`` of the tensors' bytes differ. Each replica's components are
    fingerprinted in one call, ``ts.ops.agreement_piece_fingerprints`` (the piece's one definition, the values
    MultiWorkerMirrored's check compares across ranks), on the devices they live on.

    Args:
        items: every tensor the slice covers, in a fixed order (the piece is cut from their bytes laid end to
            end), with its components, replica 0's first (one component: nothing to compare).
        name_of, cause: as for :func:`check_replicas`.
    """
    replicas = max((len(comps) for _, comps in items), default=0)
    if replicas < 2:
        return
    rows = [ops.agreement_piece_fingerprints([comps[k] if k < len(comps) else comps[0] for _, comps in items],
                                             piece, slices).tolist() for k in range(replicas)]
    for i, (t, comps) in enumerate(items):
        values = [row[i] for row in rows[:len(comps)]]
        if len(set(values)) > 1:
            raise divergence_error(name_of(t), kind_of(t), "replicas", _groups(values), when, cause(t))


class RankAgreement:
    """Compares tensors across the ranks of one process group (MultiWorkerMirrored's).

    Args:
        all_reduce: ``fn(op, tensors) -> reduced tensors`` over every rank (the strategy's process group; it may
            reduce the tensors it is given in place).
        rank, world: this rank and the group's size.
        device: where the collective's tensors live (the rank's device: NCCL reduces only GPU tensors).
    """

    def __init__(self, all_reduce: Callable[[ReduceOp, list[torch.Tensor]], list[torch.Tensor]], rank: int,
                 world: int, device: torch.device) -> None:
        self._all_reduce = all_reduce
        self.rank, self.world, self.device = rank, world, device

    def _payload(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor([*values, *(-v for v in values)], dtype=torch.int64).to(self.device)

    @staticmethod
    def _split(most: torch.Tensor) -> tuple[list[int], list[int]]:
        both = most.tolist()
        n = len(both) // 2
        return both[:n], [-v for v in both[n:]]

    def max_min(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        """The element-wise max and min of int64 ``values`` (non-negative, or flags) over the ranks: ONE MAX
        all-reduce of ``[v, -v]``."""
        (most,) = self._all_reduce(ReduceOp.MAX, [self._payload(values)])
        return self._split(most)

    def max_min_payload(self, payload: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """:meth:`max_min` of ``payload``, an int64 tensor on the rank's device already laid out as ``[v, -v]``
        (``ops.agreement_hash_``'s), which it reduces in place: ONE MAX all-reduce, at once; None when every
        rank holds the same payload (max == min everywhere)."""
        (most,) = self._all_reduce(ReduceOp.MAX, [payload.to(self.device)])   # (CPU: the same tensor)
        hi, lo = self._split(most)
        return None if hi == lo else (hi, lo)

    def differing(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The indices of ``tensors`` whose copies differ between the ranks (every rank calls it with the
        same list)."""
        if not tensors:
            return []
        hi, lo = self.max_min(fingerprint_list(tensors))
        return [i for i, (a, b) in enumerate(zip(hi, lo)) if a != b]

    def holders(self, values: Sequence[int]) -> list[list[list[int]]]:
        """Per value (a fingerprint each rank holds), the ranks grouped by the value they hold (rank 0's group
        first): one SUM all-reduce of a (world, len) table where each rank writes its own row. Only on the
        error path."""
        table = torch.zeros(self.world, len(values), dtype=torch.int64)
        table[self.rank] = torch.tensor(list(values), dtype=torch.int64)
        (summed,) = self._all_reduce(ReduceOp.SUM, [table.to(self.device)])
        summed = summed.cpu()
        return [_groups(summed[:, j].tolist()) for j in range(len(values))]

    def raise_for(self, named: Sequence[tuple[str, torch.Tensor]], when: str,
                  cause: Callable[[torch.Tensor], str], fingerprint: int | None = None) -> None:
        """Raises the error for the first of ``named`` (tensors known to differ), naming the ranks by
        ``fingerprint`` (what this rank compared; None: the tensor's, hashed whole now)."""
        name, t = named[0]
        (groups,) = self.holders([fingerprint_list([t])[0] if fingerprint is None else fingerprint])
        raise divergence_error(name, kind_of(t), "ranks", groups, when, cause(t))

    def check(self, named: Sequence[tuple[str, torch.Tensor]], when: str,
              cause: Callable[[torch.Tensor], str]) -> None:
        """Raises ``ReplicaDivergenceError`` (on every rank) unless every rank holds the same ``named`` tensors."""
        bad = self.differing([t for _, t in named])
        if bad:
            self.raise_for([named[i] for i in bad], when, cause)
