"""The creation tracker behind ``strategy.scope()``.

Global torch hooks that forward to the strategy whose scope is current in the calling thread (cross-replica
context of a non-default strategy); outside such a scope they do nothing. They are the patch set
``PATCHES`` (``distribute/torch_patches.py``): installed when the first strategy is made, removed when the
last one is shut down or collected:

* ``torch.nn.modules.module.register_module_parameter_registration_hook`` ->
  ``extended._create_parameter(module, name, param)`` (may return a replacement Parameter);
* ``register_module_buffer_registration_hook`` -> ``extended._create_buffer(module, name, buffer)``;
* ``register_module_module_registration_hook`` -> the module is tracked;
* ``torch.nn.Module.__setstate__`` is wrapped -> a module rebuilt by ``copy.deepcopy`` or unpickling in the
  scope is tracked like a module constructed there (its parameters are not registered again);
* ``torch.optim.Optimizer.__init__`` is wrapped -> ``extended._on_optimizer_created(optimizer)`` right
  after the base ``__init__`` returns (``param_groups``/``defaults``/``state`` exist; attributes a
  subclass sets after its ``super().__init__`` call may not exist yet); which strategy's scope made it is
  kept in ``OPTIMIZERS`` (an :class:`OptimizerOwners`, keyed weakly by the optimizer: nothing is written on
  the user's object).

Modules that had a parameter, buffer or submodule registered inside the scope are tracked; the roots
among them (those that are not a submodule of another tracked module) are handed to
``extended._on_module_created(module)`` once they are fully constructed: when the outermost scope of the
strategy exits, or at the next ``strategy.run``, whichever comes first.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.nn.modules import module as _module_mod

from torchstrategies.distribute import context
from torchstrategies.distribute.torch_patches import PatchSet, wrap_attribute

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.distribute.distribute_lib import StrategyExtended

__all__ = ["OPTIMIZERS", "PATCHES", "OptimizerOwners", "current_extended"]

T = TypeVar("T", bound=torch.Tensor)


def current_extended() -> StrategyExtended | None:
    """The StrategyExtended whose scope is current in cross-replica context, else None."""
    mode = context.current_mode()
    if mode.is_default or mode.cross_replica is None:
        return None
    return mode.strategy.extended


class OptimizerOwners:
    """Which strategy's scope made each optimizer: recorded once, when ``Optimizer.__init__`` returns in a
    scope; read by the in-process strategies' step guard and merged step (``strategies/mirrored.py``).
    Keyed weakly by the optimizer and holding the strategy weakly, so it extends no lifetime; an entry
    outlives its strategy (the optimizer stays "made in a scope", with no owner)."""

    def __init__(self) -> None:
        self._owners: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[StrategyExtended]] = (
            weakref.WeakKeyDictionary())

    def record(self, optimizer: torch.optim.Optimizer, extended: StrategyExtended) -> bool:
        """Records ``extended`` as ``optimizer``'s owner; False (and nothing changes) if it has one already."""
        if optimizer in self._owners:
            return False
        self._owners[optimizer] = weakref.ref(extended)
        return True

    def made_in_a_scope(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` was made in some strategy's scope (alive or not)."""
        return optimizer in self._owners

    def owner(self, optimizer: torch.optim.Optimizer) -> StrategyExtended | None:
        """The live StrategyExtended whose scope made ``optimizer``, else None."""
        ref = self._owners.get(optimizer)
        return ref() if ref is not None else None


OPTIMIZERS = OptimizerOwners()


def _parameter_hook(
    module: torch.nn.Module, name: str, param: torch.nn.Parameter | None
) -> torch.nn.Parameter | None:
    return _registered(module, param, lambda ext, p: ext._create_parameter(module, name, p))


def _buffer_hook(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
    return _registered(module, buffer, lambda ext, b: ext._create_buffer(module, name, b))


def _registered(
    module: torch.nn.Module, tensor: T | None, create: Callable[[StrategyExtended, T], T | None]
) -> T | None:
    """A parameter or buffer registered on ``module`` in the scope: tracked, and ``create`` may replace it."""
    ext = current_extended()
    if ext is None or tensor is None:
        return None
    ext._track_module(module)
    new = create(ext, tensor)
    ext._register_created_variable(new if new is not None else tensor)
    return new


def _module_hook(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    ext = current_extended()
    if ext is None or submodule is None:
        return None
    ext._track_module(module)
    ext._track_module(submodule)
    return None


def _optimizer_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:  # torch's own signature
        orig(self, *args, **kwargs)
        ext = current_extended()
        if ext is not None and OPTIMIZERS.record(self, ext):
            ext._on_optimizer_created(self)

    return __init__


def _module_setstate(orig: Callable[[torch.nn.Module, dict], None]) -> Callable[[torch.nn.Module, dict], None]:
    @functools.wraps(orig)
    def __setstate__(self: torch.nn.Module, state: dict) -> None:
        orig(self, state)
        ext = current_extended()
        if ext is not None:
            ext._track_module(self)

    return __setstate__


# torch annotates the registration hooks as returning None, but uses a returned tensor as the replacement.
PATCHES = PatchSet("creation", [
    lambda: _module_mod.register_module_parameter_registration_hook(_parameter_hook).remove,  # type: ignore[arg-type]
    lambda: _module_mod.register_module_buffer_registration_hook(_buffer_hook).remove,  # type: ignore[arg-type]
    lambda: _module_mod.register_module_module_registration_hook(_module_hook).remove,
    lambda: wrap_attribute(torch.optim.Optimizer, "__init__", _optimizer_init),
    lambda: wrap_attribute(torch.nn.Module, "__setstate__", _module_setstate),
])
