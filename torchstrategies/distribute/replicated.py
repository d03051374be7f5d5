"""In-process replicas of parameters and buffers (used by MirroredStrategy and CentralStorageStrategy).

Parameters and buffers stay ordinary ``nn.Parameter`` / ``torch.Tensor`` objects; what differs between
replicas lives in a ``ReplicaSlot`` per tensor, and the replica scheduler (``mirrored_run``) swaps it in
when it hands control to a replica. The replica threads run one at a time, so at any moment the tensors
hold exactly one replica's view:

* ``.grad`` of a parameter: each replica has its own gradient slot (``p.grad`` inside ``run`` is the
  replica's gradient); cross-replica context (outside ``run``, in merge_call, in the optimizer step) sees
  the primary gradient, which ``aggregate_gradients`` sets to the SUM of the replicas' slots.
* ``.data`` of a parameter: a replica on the parameter's own device computes with the primary storage
  itself; a replica on another device gets its own copy, refreshed from the primary whenever the primary
  changed (its version counter moved).
* ``.data`` of a buffer (ON_READ, TF's SyncOnRead): every replica other than a replica 0 on the buffer's
  device updates its own copy; when control returns to cross-replica context the copies are folded into
  the primary with the buffer's aggregation (MEAN for floating buffers, ONLY_FIRST_REPLICA for integer
  ones such as ``num_batches_tracked``) and re-seeded from it at their next use. For the linear updates
  buffers receive (running averages, counters) this is exactly TF's ON_READ value.

Between two replicas that share the primaries' storage (CPU replicas, or replicas on the parameters' own
device) ``hand_over`` swaps only the gradients, in one pass. A slot drops what replicas held for its
tensor (gradients, copies) when the tensor dies.

Because nothing is a tensor subclass, whatever torch does to a module keeps working: ``copy.deepcopy``
(the copies are found again through the module tree and the optimizers), ``.to()``, ``state_dict``,
parametrizations, hooks, ``torch.func.functional_call`` and ``torch.compile``, which sees plain tensors.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from torchstrategies._ext import _C
from torchstrategies.distribute.enums import VariableAggregation
from torchstrategies.distribute.values import PerReplica
from torchstrategies.reduce_op import ReduceOp

__all__ = ["ReplicaSlot", "ReplicaSlots", "replica_components"]


class ReplicaSlot:
    """What replicas hold apart for one tensor: per-replica gradients (parameters) and storages."""

    __slots__ = (
        "ref", "is_param", "aggregation", "grads", "copies", "seeds", "home_data", "home_grad", "epoch",
        "home_key", "__weakref__",
    )

    def __init__(self, t: torch.Tensor, is_param: bool, n: int):
        self.ref = weakref.ref(t, functools.partial(_forget_slot, weakref.ref(self)))
        self.is_param = is_param
        floating = t.is_floating_point() or t.is_complex()
        self.aggregation = (
            VariableAggregation.MEAN if floating or is_param else VariableAggregation.ONLY_FIRST_REPLICA
        )
        self.grads: list[torch.Tensor | None] = [None] * n
        self.copies: list[torch.Tensor | None] = [None] * n
        self.seeds: list[Any] = [None] * n
        self.home_data: torch.Tensor | None = None
        self.home_grad: torch.Tensor | None = None
        self.epoch = 0  # buffers: bumped whenever the primary changes in cross-replica context
        self.home_key: tuple | None = None  # buffers: the primary as cross-replica context last left it


def _forget_slot(slot_ref: weakref.ref[ReplicaSlot], _tensor_ref: Any) -> None:
    """Its tensor died: what the replicas held for it (gradients, copies) goes too, not at the next run."""
    slot = slot_ref()
    if slot is not None:
        n = len(slot.grads)
        slot.grads = [None] * n
        slot.copies = [None] * n
        slot.seeds = [None] * n
        slot.home_data = slot.home_grad = None


def _key(t: torch.Tensor) -> tuple:
    return (t._version, t.data_ptr(), t.dtype, t.shape, t.device)


class ReplicaSlots:
    """The replica view of every replicated tensor of one strategy, and the swap between replicas.

    Args:
        devices: the replicas' compute devices (index = local replica id).
        cross_device_ops: what folds ON_READ buffers (``reduce(op, PerReplica, device)``).
    """

    def __init__(self, devices: tuple[torch.device, ...], cross_device_ops: Any):
        self.devices = devices
        self.n = len(devices)
        self.cross_device_ops = cross_device_ops
        self._slots: dict[int, ReplicaSlot] = {}
        self._active: list[ReplicaSlot] = []
        self.active_index: int | None = None  # the replica whose view is swapped in (None: cross-replica)
        self._grads_only = False  # the active replica's view differs from the primaries in gradients only
        self._params_only = False  # every swapped tensor is a parameter (no buffers): _C.swap_gradients may swap
        self.buffers_dirty = False  # a replica may have written a buffer copy since the last fold
        self._key: tuple[list[int], list[int]] | None = None  # what ``refresh`` last saw
        self.generation = 0  # bumped whenever the replicated set changes (plans built on it are stale)

    # -- membership -------------------------------------------------------------------------------
    def slot(self, t: torch.Tensor) -> ReplicaSlot | None:
        s = self._slots.get(id(t))
        if s is None or s.ref() is not t:
            return None
        return s

    def contains(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self.slot(t) is not None

    def refresh(
        self, params: Iterable[torch.Tensor | None], buffers: Iterable[torch.Tensor | None]
    ) -> None:
        """Makes ``params`` and ``buffers`` the replicated set (called in cross-replica context)."""
        params = list(params)
        buffers = list(buffers)
        key = ([id(t) for t in params], [id(t) for t in buffers])
        if self.n > 1 and key == self._key and all(s.ref() is not None for s in self._slots.values()):
            return  # the same live tensors (an id is unique among live objects), all swapped: as before
        self._key = key
        old = self._slots
        new: dict[int, ReplicaSlot] = {}
        for group, is_param in ((params, True), (buffers, False)):
            for t in group:
                if t is None or id(t) in new:
                    continue
                s = old.get(id(t))
                if s is None or s.ref() is not t or s.is_param != is_param:
                    s = ReplicaSlot(t, is_param, self.n)
                new[id(t)] = s
        self._slots = new
        self._active = [s for s in new.values() if self._needs_swap(s)]
        self._params_only = all(s.is_param for s in self._active)
        self.generation += 1

    def _needs_swap(self, s: ReplicaSlot) -> bool:
        t = s.ref()
        if t is None:
            return False
        return self.n > 1 or t.device != self.devices[0]

    @property
    def swaps(self) -> bool:
        """Whether any tensor differs between replicas (False: one replica on the variables' device)."""
        return bool(self._active)

    # -- the swap ---------------------------------------------------------------------------------
    def activate(self, i: int) -> None:
        """Gives every replicated tensor replica ``i``'s gradient and storage."""
        assert self.active_index is None, "a replica is already active"
        device = self.devices[i]
        if self._params_only and _C.swap_gradients(self._active, -1, i, device):
            # (in C: every parameter on replica i's device, so only gradients differ; see replica_grads.cpp)
            self.active_index = i
            self._grads_only = True
            return
        grads_only = True
        for s in self._active:
            t = s.ref()
            if t is None:
                continue
            if s.is_param:
                s.home_grad = t.grad
                if t.device != device:
                    s.home_data = t.data
                    t.data = self._replica_copy(s, t, i, device)
                    grads_only = False
                t.grad = s.grads[i]
            else:
                grads_only = False
                key = _key(t)
                if key != s.home_key:  # written in cross-replica context: every copy re-seeds
                    s.epoch += 1
                    s.home_key = key
                if i == 0:  # a round starts: seed every copy before replica 0 may write the primary
                    for j in range(1 if t.device == device else 0, self.n):
                        self._buffer_copy(s, t, j, self.devices[j])
                if i > 0 or t.device != device:
                    s.home_data = t.data
                    t.data = self._buffer_copy(s, t, i, device)
                self.buffers_dirty = True
        self.active_index = i
        self._grads_only = grads_only

    def hand_over(self, i: int) -> None:
        """``deactivate()`` then ``activate(i)``; in one pass when both replicas' views differ from the
        primaries in gradients only (parameters where they live, no buffers), as for CPU replicas."""
        j = self.active_index
        if j is None or not self._grads_only or self.devices[i] != self.devices[j]:
            self.deactivate()
            self.activate(i)
            return
        if self._params_only and _C.swap_gradients(self._active, j, i, self.devices[i]):
            self.active_index = i
            return
        for s in self._active:
            t = s.ref()
            if t is not None:
                s.grads[j] = t.grad
                t.grad = s.grads[i]
        self.active_index = i

    def deactivate(self) -> None:
        """Stores the active replica's gradients/storages and restores the primaries (main thread)."""
        i = self.active_index
        if i is None:
            return
        self.active_index = None
        if self._grads_only and self._params_only and _C.swap_gradients(self._active, i, -1, self.devices[i]):
            return
        for s in self._active:
            t = s.ref()
            if t is None:
                continue
            if s.is_param:
                g = t.grad
                s.grads[i] = g
                if s.home_data is not None:
                    if g is not None:
                        t.grad = None  # a gradient on the replica's device cannot sit on the primary
                    t.data = s.home_data
                    s.home_data = None
                t.grad = s.home_grad
                s.home_grad = None
            else:
                if s.home_data is not None:
                    t.data = s.home_data
                    s.home_data = None
                s.home_key = _key(t)  # replica 0's own writes to the primary are not cross-replica writes

    @staticmethod
    def _seeded(s: ReplicaSlot, t: torch.Tensor, i: int, device: torch.device, seed: Any) -> torch.Tensor:
        comp = s.copies[i]
        if comp is None or s.seeds[i] != seed:
            with torch.no_grad():
                if comp is not None and comp.shape == t.shape and comp.dtype == t.dtype:
                    comp.copy_(t.detach())
                else:
                    comp = t.detach().to(device, copy=True)
                    s.copies[i] = comp
            s.seeds[i] = seed
        return comp

    def _replica_copy(self, s: ReplicaSlot, t: torch.Tensor, i: int, device: torch.device) -> torch.Tensor:
        return self._seeded(s, t, i, device, _key(t))

    def _buffer_copy(self, s: ReplicaSlot, t: torch.Tensor, i: int, device: torch.device) -> torch.Tensor:
        return self._seeded(s, t, i, device, s.epoch)

    # -- cross-replica views ----------------------------------------------------------------------
    def fold_buffers(self) -> None:
        """Aggregates the replicas' buffer copies into the primaries (the ON_READ cross-replica value)."""
        if not self.buffers_dirty:
            return
        self.buffers_dirty = False
        with torch.no_grad():
            for s in self._active:
                t = s.ref()
                if t is None or s.is_param:
                    continue
                comps = [self._current(s, t, i) for i in range(self.n)]
                agg = s.aggregation
                if agg == VariableAggregation.ONLY_FIRST_REPLICA or len(comps) == 1:
                    val = comps[0]
                else:
                    op = ReduceOp.SUM if agg == VariableAggregation.SUM else ReduceOp.MEAN
                    val = self.cross_device_ops.reduce(op, PerReplica(tuple(comps)), t.device)
                if val is not t:
                    t.copy_(val.to(t.device))
                s.epoch += 1  # every copy re-seeds from the folded primary at its next use
                s.home_key = _key(t)

    def _current(self, s: ReplicaSlot, t: torch.Tensor, i: int) -> torch.Tensor:
        """Replica ``i``'s value of buffer ``t`` (its copy when seeded from the current primary)."""
        if i == 0 and t.device == self.devices[0]:
            return t
        comp = s.copies[i]
        if comp is not None and s.seeds[i] == s.epoch:
            return comp
        return t.detach().to(self.devices[i])  # not used since the last fold: still the seeded value

    def replica_gradients(self, p: torch.Tensor) -> list[torch.Tensor | None]:
        s = self.slot(p)
        return list(s.grads) if s is not None else [p.grad]

    def clear_replica_gradients(self, p: torch.Tensor) -> None:
        s = self.slot(p)
        if s is not None:
            s.grads = [None] * self.n

    def hand_down_gradient(self, p: torch.Tensor) -> None:
        """After aggregation: replica 0 starts from the summed gradient, the others from None.

        So a later backward without ``zero_grad`` accumulates onto the sum once (one device's
        ``g_s + g_{s+1}``), and a replica's ``zero_grad`` clears it as one device's would.
        """
        s = self.slot(p)
        if s is None or p.grad is None:
            return
        self.hand_down(s, p.grad)

    def hand_down(self, s: ReplicaSlot, g: torch.Tensor) -> None:
        """``hand_down_gradient`` for slot ``s`` whose parameter's summed gradient ``g`` is."""
        d0 = self.devices[0]
        s.grads = [g if g.device == d0 else g.to(d0)] + [None] * (self.n - 1)

    def components(self, t: torch.Tensor) -> list[torch.Tensor | None]:
        s = self.slot(t)
        if s is None:
            return [t]
        out: list[torch.Tensor | None] = []
        for i, d in enumerate(self.devices):
            if s.is_param and t.device == d:
                out.append(t)
            elif not s.is_param and i == 0 and t.device == d:
                out.append(t)
            else:
                out.append(s.copies[i])
        return out


def replica_components(t: torch.Tensor, slots: ReplicaSlots | None = None) -> list[torch.Tensor | None]:
    """The tensors replica 0..N-1 use for ``t`` (None where a replica has not used its copy yet)."""
    if slots is None:
        return [t]
    return slots.components(t)
