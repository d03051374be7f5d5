"""Every learning-rate scheduler's ``step``, wrapped for the in-process replicas: once per step, not once per
replica.

``LRScheduler.step`` is not the only ``step``: ``CosineAnnealingWarmRestarts``, ``SequentialLR``,
``ChainedScheduler`` (and a user's subclass) define their own, which never call the base one, so wrapping
the base alone let each replica advance such a schedule (N replicas: N epochs a step, or a merge_call
mismatch when the replicas then took different branches). So the wrapper goes on each class that defines
``step``: those that exist when the patches are installed, and any defined while they are
(``LRScheduler.__init_subclass__``). A ``step`` that calls another one (``super().step()``, a
``SequentialLR``'s child) runs inside the first's merge function, in cross-replica context, where the wrapper
calls through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchstrategies.distribute.torch_patches import Undo, wrap_attribute

__all__ = ["wrap_scheduler_steps"]

Make = Callable[[Any], Any]


def wrap_scheduler_steps(once: Make, plateau: Make) -> Undo:
    """Wraps ``step`` of ``LRScheduler`` and of each subclass that defines one, now and later, with
    ``once`` (``ReduceLROnPlateau`` and its subclasses: ``plateau``); returns the undo of all of it."""
    undos: list[Undo] = []

    def wrap(cls: type) -> None:
        if "step" in cls.__dict__:
            undos.append(wrap_attribute(cls, "step", plateau if issubclass(cls, ReduceLROnPlateau) else once))

    def walk(cls: type) -> None:
        wrap(cls)
        subclasses: list[type] = type.__subclasses__(cls)
        for sub in subclasses:
            walk(sub)

    def init_subclass(cls: type, **kwargs: Any) -> None:
        super(LRScheduler, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        wrap(cls)

    assert "__init_subclass__" not in LRScheduler.__dict__, "torch defines LRScheduler.__init_subclass__ now"
    walk(LRScheduler)
    hook: Any = classmethod(init_subclass)
    LRScheduler.__init_subclass__ = hook  # type: ignore[assignment,method-assign]

    def undo() -> None:
        if LRScheduler.__dict__.get("__init_subclass__") is hook:
            del LRScheduler.__init_subclass__
        while undos:
            undos.pop()()

    return undo
