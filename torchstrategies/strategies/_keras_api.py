"""Everything torchstrategies uses of Keras 3 (torch backend), named and typed in one place.

``strategies/_keras.py`` (and its ``_keras_replicas.py``, ``_keras_worker.py``, ``_keras_in_process.py``)
reach a Keras object only through this module: the :class:`typing.Protocol` classes below list each
attribute and method they read, and :func:`override` / :func:`remove_override` are the one way they
replace one on an instance (the class is never touched). When a Keras release renames or
drops one of them, :func:`check` names it here (``tests/test_keras_adapter.py`` runs it against the current
and the previous Keras minor release), instead of an ``AttributeError`` deep in a train step or, worse, a
silently local statistic.

What is private to Keras (``_flatten_layers``, ``BatchNormalization._moments`` / ``_reduction_axes``) is
used because Keras offers no public hook for it: the global batch statistics replace ``_moments``, the
layers are walked with ``_flatten_layers``.

Keras is never imported here: objects are recognized by their classes' names (``BatchNormalization``,
``ModelCheckpoint``) and their attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol, cast

import torch

__all__ = ["KerasVariable", "KerasOptimizer", "KerasModel", "CompiledModel", "BatchNormLayer", "SeedGenerator",
           "RandomLayer", "ModelCheckpointCallback", "KerasAdapterError", "as_model", "layers", "batch_norm",
           "random_layer", "model_checkpoint", "compiled", "iterations", "override", "remove_override", "check",
           "members"]


class KerasVariable(Protocol):
    """A ``keras.Variable`` on the torch backend: ``value`` is its ``torch.nn.Parameter``."""

    @property
    def value(self) -> torch.Tensor: ...

    @property
    def aggregation(self) -> str: ...

    def assign(self, value: torch.Tensor) -> object: ...


class KerasOptimizer(Protocol):
    """A Keras optimizer: its step count and the update from gradients."""

    @property
    def iterations(self) -> KerasVariable | torch.Tensor: ...  # a tensor with gradient_accumulation_steps

    def apply(self, grads: Sequence[torch.Tensor | None], trainable_variables: Sequence[KerasVariable] | None = None
              ) -> object: ...


class KerasModel(Protocol):
    """A Keras model: its loop (``fit`` and the steps it calls), its variables and its metrics."""

    @property
    def jit_compile(self) -> bool | str: ...

    @property
    def metrics_variables(self) -> Sequence[KerasVariable]: ...

    @property
    def non_trainable_variables(self) -> Sequence[KerasVariable]: ...

    @property
    def trainable_variables(self) -> Sequence[KerasVariable]: ...

    def train_step(self, data: Any) -> Any: ...

    def test_step(self, data: Any) -> Any: ...

    def fit(self, *args: Any, **kwargs: Any) -> Any: ...

    def compile(self, *args: Any, **kwargs: Any) -> Any: ...

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any: ...

    def get_metrics_result(self) -> dict[str, Any]: ...

    def _flatten_layers(self, include_self: bool = True, recursive: bool = True) -> Iterable[object]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


class CompiledModel(KerasModel, Protocol):
    """A Keras model after ``compile``: it has an optimizer (a model made in a scope is compiled later)."""

    @property
    def optimizer(self) -> KerasOptimizer | None: ...


class BatchNormLayer(Protocol):
    """``keras.layers.BatchNormalization``: ``_moments(inputs, mask)`` gives the batch's mean and variance
    over ``_reduction_axes``."""

    @property
    def name(self) -> str: ...

    @property
    def _reduction_axes(self) -> Sequence[int]: ...

    def _moments(self, inputs: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class SeedGenerator(Protocol):
    """A ``keras.random.SeedGenerator``: its ``state`` variable is the seed of the next draw."""

    @property
    def state(self) -> KerasVariable: ...


class RandomLayer(Protocol):
    """A layer that draws random numbers (Dropout, GaussianNoise, random augmentation)."""

    @property
    def seed_generator(self) -> SeedGenerator: ...

    def call(self, inputs: Any, *args: Any, **kwargs: Any) -> Any: ...


class ModelCheckpointCallback(Protocol):
    """``keras.callbacks.ModelCheckpoint``: where it writes."""

    filepath: str


class KerasAdapterError(RuntimeError):
    """The installed Keras lacks an attribute or method torchstrategies uses (it renamed or dropped it)."""


# The attributes a strategy replaces on an instance (the class is untouched): the model's loop, the
# optimizer's update, a BatchNormalization's statistics, a random layer's call, and the mark of an attached
# model.
Overridden = Literal["train_step", "test_step", "fit", "compile", "compute_loss", "apply", "_moments", "call",
                     "_torchstrategies_keras"]


def members(protocol: type) -> tuple[str, ...]:
    """The attributes and methods ``protocol`` names, its base protocols' included (what this module uses of
    that kind of Keras object)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls.__module__ != __name__:  # typing.Protocol, Generic, object
            continue
        names |= {n for n in vars(cls) if not n.startswith("__") and not n.startswith(("_abc_", "_is_"))}
        names |= set(vars(cls).get("__annotations__", {}))
    return tuple(sorted(names))


def _missing(obj: object, protocol: type) -> list[str]:
    return [n for n in members(protocol) if not hasattr(obj, n)]


def check(obj: object, protocol: type, what: str) -> None:
    """Raises :class:`KerasAdapterError` naming every member of ``protocol`` that ``obj`` lacks.

    Raises:
        KerasAdapterError: e.g. "Keras' BatchNormalization 'bn' has no _moments (torchstrategies uses
            _moments, _reduction_axes, name of it) ...".
    """
    missing = _missing(obj, protocol)
    if missing:
        raise KerasAdapterError(
            f"Keras' {what} ({type(obj).__module__}.{type(obj).__qualname__}) has no {', '.join(missing)}: "
            f"torchstrategies uses {', '.join(members(protocol))} of it (strategies/_keras_api.py). This Keras "
            "release renamed or dropped them; use a Keras release the adapter supports (docs/keras.md)")


def _named(obj: object, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(obj).__mro__)


def as_model(module: object) -> KerasModel | None:
    """``module`` as a Keras model (it has Keras' training loop), else None (a layer, or not Keras)."""
    if callable(getattr(module, "train_step", None)) and callable(getattr(module, "fit", None)):
        check(module, KerasModel, "model")
        return cast(KerasModel, module)
    return None


def layers(model: KerasModel) -> Iterable[object]:
    """Every layer of ``model`` (nested ones too), not the model itself."""
    return model._flatten_layers(include_self=False, recursive=True)


def batch_norm(layer: object) -> BatchNormLayer | None:
    """``layer`` as a BatchNormalization (checked: its statistics are replaced by the global batch's), else None."""
    if not _named(layer, "BatchNormalization"):
        return None
    check(layer, BatchNormLayer, f"BatchNormalization {getattr(layer, 'name', '?')!r}")
    return cast(BatchNormLayer, layer)


def random_layer(layer: object) -> RandomLayer | None:
    """``layer`` as a layer that draws random numbers (it has a ``seed_generator``), else None."""
    seed = getattr(layer, "seed_generator", None)
    if seed is None:
        return None
    check(seed, SeedGenerator, f"SeedGenerator of {getattr(layer, 'name', '?')!r}")
    check(layer, RandomLayer, f"random layer {getattr(layer, 'name', '?')!r}")
    return cast(RandomLayer, layer)


def model_checkpoint(callback: object) -> ModelCheckpointCallback | None:
    """``callback`` as a ModelCheckpoint (it writes files), else None."""
    if not _named(callback, "ModelCheckpoint"):
        return None
    check(callback, ModelCheckpointCallback, "ModelCheckpoint")
    return cast(ModelCheckpointCallback, callback)


def compiled(model: KerasModel) -> CompiledModel:
    """``model`` in its loop, after ``compile`` (checked, with its optimizer when it has one)."""
    check(model, CompiledModel, "compiled model")
    opt = cast(CompiledModel, model).optimizer
    if opt is not None:
        check(opt, KerasOptimizer, "optimizer")
    return cast(CompiledModel, model)


def iterations(opt: KerasOptimizer | None) -> int | None:
    """The steps ``opt`` has applied (None: no optimizer, as ``evaluate`` of a model compiled without one). A
    Keras variable, or with ``gradient_accumulation_steps`` a tensor computed from one."""
    if opt is None:
        return None
    steps = opt.iterations
    return int(steps if isinstance(steps, torch.Tensor) else steps.value)


def override(obj: object, name: Overridden, fn: Callable[..., Any] | object) -> None:
    """Replaces ``name`` on the instance ``obj`` (its class is untouched; :func:`remove_override` undoes it)."""
    object.__setattr__(obj, name, fn)


def remove_override(obj: object, name: Overridden) -> None:
    """Drops the instance's ``name`` set by :func:`override`: the class's own is seen again."""
    object.__delattr__(obj, name)
