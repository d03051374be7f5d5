"""Plain attributes that modules write in replica context, one value per in-process replica.

A module that keeps state on itself across steps (a stateful RNN's ``self.hidden = h.detach()``, a cache,
``weight_norm``'s computed weight) writes a plain attribute in its forward. On one device (and under
MultiWorkerMirrored, a process per replica) that state is of the rows this device saw; in-process replicas
share the module object, so without this replica 1 would read what replica 0 wrote. Here such an attribute
is ON_WRITE with aggregation NONE, as a parameter is (TF 2.x: a replica's write stays in its component):

* ``Module.__setattr__`` inside ``run`` (``strategies/mirrored.py`` wraps it while an in-process strategy
  lives) on a module made in the scope, for a name that is not a parameter, buffer or submodule: the
  attribute becomes tracked; every replica starts from the value it had before the first write;
* each replica reads and writes its own value (swapped into the module's ``__dict__`` when the replica runs,
  beside ``ReplicaViews.enter``), kept across runs;
* cross-replica code (merge functions, between runs) sees replica 0's value; a write there (say
  ``model.hidden = None`` at an epoch's start) reaches every replica at the next run.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["ReplicaAttributes"]

_MISSING = object()  # the attribute did not exist (yet) for that replica


class ReplicaAttributes:
    """The tracked attributes of one in-process strategy's modules: ``(module, name) -> value per replica``.

    Args:
        num_replicas: the strategy's local replicas.
    """

    def __init__(self, num_replicas: int) -> None:
        self._n = num_replicas
        self._slots: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list[Any]]] = weakref.WeakKeyDictionary()
        self._active: int | None = None  # the replica whose values the modules hold now (None: replica 0's)

    def written(self, module: torch.nn.Module, name: str, value: object, module_ids: set[int]) -> None:
        """Called before ``module.name = value`` in replica context: tracks a plain attribute of a module made
        in the scope (``module_ids``), from the value every replica had until now."""
        if id(module) not in module_ids or isinstance(value, (torch.nn.Parameter, torch.nn.Module)):
            return
        if name in module._parameters or name in module._buffers or name in module._modules:
            return
        slots = self._slots.setdefault(module, {})
        if name not in slots:
            slots[name] = [module.__dict__.get(name, _MISSING)] * self._n

    def begin(self) -> None:
        """At the start of a run: an attribute cross-replica code replaced since reaches every replica."""
        for module, slots in list(self._slots.items()):
            for name, values in slots.items():
                now = module.__dict__.get(name, _MISSING)
                if now is not values[0]:
                    values[:] = [now] * self._n

    def enter(self, replica: int) -> None:
        """The modules hold ``replica``'s values."""
        if self._slots:
            self._put(replica)
        self._active = replica

    def leave(self) -> None:
        """Keeps the active replica's values; the modules hold replica 0's (the cross-replica view)."""
        active, self._active = self._active, None
        if active is None or not self._slots:
            return
        for module, slots in list(self._slots.items()):
            for name, values in slots.items():
                values[active] = module.__dict__.get(name, _MISSING)
        if active != 0:
            self._put(0)

    def _put(self, replica: int) -> None:
        for module, slots in list(self._slots.items()):
            for name, values in slots.items():
                value = values[replica]
                if value is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
