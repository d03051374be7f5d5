"""Every change torchstrategies makes to torch's process-wide state, and when it is undone.

Strategies need a few of torch's globals: module registration hooks and wrapped ``Optimizer.__init__`` /
``Module.__setstate__`` (the creation tracker behind ``scope()``), an optimizer step pre-hook and wrapped
``GradScaler`` / ``LRScheduler`` / optimizer-class ``step`` methods (in-process replicas), a step pre-hook
per MultiWorkerMirroredStrategy. Each group of them is a :class:`PatchSet`, installed when its first
holder (a live strategy) acquires it and undone when the last one releases it: every live strategy
holds a :class:`Lease`, released by the strategy's ``shutdown()`` or when the strategy is garbage
collected, whichever comes first. With no strategy alive, torch's classes, hooks and registries are as
they were before the first one, and modules and optimizers pay for nothing.

A wrapper that something else wrapped again after us (another library patching the same method) cannot
be taken out without breaking that library: it stays, and does nothing outside a strategy's scope.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["PatchSet", "Lease", "Undo", "wrap_attribute"]

_log = logging.getLogger("torchstrategies.distribute")
_lock = threading.RLock()
Undo = Callable[[], None]
_MISSING = object()


def wrap_attribute(cls: object, name: str, make: Callable[[Any], Any]) -> Undo:
    """Sets ``cls.name = make(cls.name)`` (``cls``: a class or a module); the returned undo puts back exactly
    what ``cls.__dict__`` held (or deletes the attribute where ``cls`` only inherited it)."""
    own = cls.__dict__.get(name, _MISSING)
    wrapper = make(getattr(cls, name))
    setattr(cls, name, wrapper)

    def undo() -> None:
        if cls.__dict__.get(name, _MISSING) is not wrapper:
            owner = getattr(cls, "__qualname__", getattr(cls, "__name__", repr(cls)))
            _log.debug("%s.%s was wrapped again by someone else; ours stays, inert", owner, name)
            return
        if own is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, own)

    return undo


class Lease:
    """One holder's claim on a :class:`PatchSet`; ``release()`` is idempotent."""

    def __init__(self, patches: PatchSet):
        self._patches: PatchSet | None = patches

    def release(self) -> None:
        with _lock:
            patches, self._patches = self._patches, None
        if patches is not None:
            patches._release()

    @property
    def held(self) -> bool:
        return self._patches is not None


class PatchSet:
    """A named group of changes to torch's globals, installed while at least one lease is held.

    Args:
        name: for the log.
        installers: each installs one change and returns its undo.

    Example:
        >>> import torch
        >>> ps = PatchSet("demo", [lambda: torch.nn.modules.module.register_module_forward_hook(
        ...     lambda m, i, o: None).remove])
        >>> lease = ps.acquire(); ps.installed
        True
        >>> lease.release(); ps.installed
        False
    """

    def __init__(self, name: str, installers: list[Callable[[], Undo]]):
        self.name = name
        self._installers = installers
        self._count = 0
        self._undo: list[Undo] = []

    @property
    def installed(self) -> bool:
        return self._count > 0

    def acquire(self, owner: object | None = None) -> Lease:
        """Installs the set if nobody holds it; the lease is released when ``owner`` is collected."""
        with _lock:
            if self._count == 0:
                try:
                    for install in self._installers:
                        self._undo.append(install())
                except BaseException:
                    self._undo_all()
                    raise
                _log.debug("torch patches %r installed", self.name)
            self._count += 1
            lease = Lease(self)
        if owner is not None:
            weakref.finalize(owner, lease.release)
        return lease

    def add(self, install: Callable[[], Undo]) -> None:
        """Installs one more change now (the set must be held), undone with the set."""
        with _lock:
            if self._count == 0:
                raise RuntimeError(f"torch patches {self.name!r} are not installed; acquire a lease first")
            self._undo.append(install())

    def _release(self) -> None:
        with _lock:
            self._count -= 1
            if self._count == 0:
                self._undo_all()
                _log.debug("torch patches %r removed", self.name)

    def _undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()
