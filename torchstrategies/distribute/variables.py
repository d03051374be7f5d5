"""``ts.Variable``: state with TF's synchronization and aggregation rules.

Outside a strategy scope (and under OneDeviceStrategy) a Variable is one tensor. Created inside the scope
of a strategy with several local replicas it is distributed, with one component per local replica:

* ON_WRITE (``synchronization=AUTO`` or ``ON_WRITE``): a MirroredVariable. Reads give the replica's (or in
  cross-replica context the first) component. An assign in cross-replica context writes every component;
  in replica context it goes through ``merge_call``: the replicas' values are aggregated with the
  variable's ``aggregation`` (SUM / MEAN / ONLY_FIRST_REPLICA) and the result written everywhere. SUM of a
  value that is the same object on every replica is a ValueError (TF's ``reduce_non_distributed_value``).
  With aggregation NONE (the default) a replica-context write goes to the replica's own component only, as
  in TF 2.x: the components may diverge, and a cross-replica read gives component 0. (A CentralStorage
  variable, one copy shared by every replica, refuses that write, as TF's AggregatingVariable does.)
* ON_READ: a SyncOnReadVariable. In replica context each replica reads and writes its own component. In
  cross-replica context a read aggregates the components (SUM/MEAN; ONLY_FIRST_REPLICA reads component 0);
  ``assign(v)`` writes ``v / num_replicas`` to each component when aggregation is SUM (so the sum reads
  back as ``v``) and ``v`` otherwise; ``assign_add``/``assign_sub`` are errors for SUM and apply to every
  component otherwise. With aggregation NONE every cross-replica read or write is TF's ValueError.

``strategy.experimental_local_results(variable)`` gives the components (this process's replicas).

Errors at creation under a multi-replica strategy: synchronization NONE; MEAN aggregation of an integer
variable (the mean of integers is not an integer). Variables are state (counters, metrics, moving
averages); train weights as ``nn.Parameter``s of modules. A Variable is usable as a tensor: torch
functions and arithmetic operators read its current value.

Example:
    >>> import torch, torchstrategies as ts
    >>> s = ts.MirroredStrategy(num_replicas=2)
    >>> with s.scope():
    ...     steps = ts.Variable(0.0, aggregation=ts.VariableAggregation.ONLY_FIRST_REPLICA)
    >>> _ = s.run(lambda: steps.assign_add(1.0))
    >>> float(steps)
    1.0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.utils._pytree import tree_map_only

from torchstrategies.distribute import context
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from torchstrategies.distribute.distribute_lib import Strategy, StrategyExtended

__all__ = [
    "Variable",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "aggregation_error_msg",
    "create_distributed_variable",
]

# What a variable is created from or written with: a tensor, a number, another Variable.
VariableValue: TypeAlias = "torch.Tensor | float | Sequence[float] | Variable"
# An in-place write of a value into one component (``copy_``, ``add_``, ``sub_``).
_Write: TypeAlias = Callable[[torch.Tensor, torch.Tensor], object]
_Index: TypeAlias = "int | slice | torch.Tensor | EllipsisType | None"


def _as_tensor(value: VariableValue | Callable[[], VariableValue] | None) -> torch.Tensor:
    if callable(value) and not isinstance(value, (torch.Tensor, Variable)):
        value = value()
    if isinstance(value, Variable):
        value = value.read_value()
    if value is None:
        raise ValueError("initial_value must be specified.")
    return torch.as_tensor(value).detach().clone()


def _value_for(v: VariableValue, like: torch.Tensor) -> torch.Tensor:
    if isinstance(v, Variable):
        v = v.read_value()
    return torch.as_tensor(v).to(device=like.device, dtype=like.dtype)


class Variable:
    """A variable (``tf.Variable``); under a multi-replica strategy scope it becomes distributed.

    Args:
        initial_value: a tensor, a number, or a callable returning one.
        trainable: recorded (defaults to False for ON_READ, True otherwise).
        synchronization: a ``VariableSynchronization`` (or its name).
        aggregation: a ``VariableAggregation`` (or its name).
        name: optional name.

    Example:
        >>> import torch, torchstrategies as ts
        >>> v = ts.Variable(torch.tensor(1.0))
        >>> (v.assign_add(2.0) * 2).item()
        6.0
    """

    _components: tuple[torch.Tensor, ...]

    def __new__(
        cls,
        initial_value: VariableValue | Callable[[], VariableValue] | None = None,
        trainable: bool | None = None,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        name: str | None = None,
    ) -> Variable:
        if cls is not Variable:
            return super().__new__(cls)
        from torchstrategies.distribute.creation import current_extended

        sync = VariableSynchronization.from_any(synchronization)  # type: ignore[attr-defined]
        agg = VariableAggregation.from_any(aggregation)
        if trainable is None:
            trainable = sync != VariableSynchronization.ON_READ
        value = _as_tensor(initial_value)
        ext = current_extended()
        if ext is not None:
            v = ext._create_variable(value, sync, agg, bool(trainable), name)
        else:
            v = _new_local(value, sync, agg, bool(trainable), name)
        if ext is not None:
            ext._register_created_variable(v)
        return v

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass  # everything is set by the factory functions

    # -- tensor-like surface ----------------------------------------------------------------------
    def _setup(
        self,
        components: Sequence[torch.Tensor],
        sync: VariableSynchronization,
        agg: VariableAggregation,
        trainable: bool,
        name: str | None,
        strategy: Strategy | None = None,
    ) -> None:
        self._components = tuple(components)
        self.synchronization = sync
        self.aggregation = agg
        self.trainable = trainable
        self.name = name
        self._strategy = strategy

    @property
    def distribute_strategy(self) -> Strategy:
        return self._strategy if self._strategy is not None else context.get_strategy()

    @property
    def dtype(self) -> torch.dtype:
        return self._components[0].dtype

    @property
    def shape(self) -> torch.Size:
        return self._components[0].shape

    @property
    def device(self) -> torch.device:
        return self._components[0].device

    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        return self._components

    def value(self) -> torch.Tensor:
        return self.read_value()

    def read_value(self) -> torch.Tensor:
        """The value in the current context (a copy)."""
        return self._read().clone()

    def _read(self) -> torch.Tensor:
        return self._components[0]

    def numpy(self) -> np.ndarray:
        return self.read_value().detach().cpu().numpy()

    def assign(self, value: VariableValue) -> Variable:
        """Writes ``value`` (under a strategy: TF's rules for the synchronization, see the module)."""
        return self._write("assign", lambda c, v: c.copy_(v), value)

    def assign_add(self, value: VariableValue) -> Variable:
        """Adds ``value`` (under a strategy: TF's rules for the synchronization, see the module)."""
        return self._write("assign_add", lambda c, v: c.add_(v), value)

    def assign_sub(self, value: VariableValue) -> Variable:
        """Subtracts ``value`` (under a strategy: TF's rules for the synchronization, see the module)."""
        return self._write("assign_sub", lambda c, v: c.sub_(v), value)

    def _write(self, op: str, write: _Write, value: VariableValue) -> Variable:
        """The one seam of the three writes (``op`` names the public method): here every component."""
        with torch.no_grad():
            for c in self._components:
                write(c, _value_for(value, c))
        return self

    def __repr__(self) -> str:
        return (
            f"<ts.{type(self).__name__} name={self.name!r} shape={tuple(self.shape)} dtype={self.dtype} "
            f"value={self._read()!r}>"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: object,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> Any:
        args, kwargs = tree_map_only(Variable, lambda v: v._read(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __array__(self, dtype: np.dtype | None = None) -> np.ndarray:
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    # torch.as_tensor / torch.tensor take a variable through DLPack (a read of its value, as TF's
    # convert_to_tensor), not as a sequence.
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.read_value().detach().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._read().__dlpack_device__()

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __bool__(self) -> bool:
        return bool(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __getitem__(self, idx: _Index | tuple[_Index, ...]) -> torch.Tensor:
        return self._read()[idx]


def _binop(name: str) -> Callable[..., Any]:
    def op(self: Variable, other: object) -> Any:
        if isinstance(other, Variable):
            other = other._read()
        return getattr(self._read(), name)(other)

    op.__name__ = name
    return op


for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__pow__",
    "__rpow__",
    "__matmul__",
    "__rmatmul__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
):
    setattr(Variable, _name, _binop(_name))
setattr(Variable, "__neg__", lambda self: -self._read())  # noqa: B010 - as the loop above, outside the class body
setattr(Variable, "__abs__", lambda self: abs(self._read()))  # noqa: B010
Variable.__hash__ = object.__hash__  # type: ignore[assignment]


class _LocalVariable(Variable):
    """One tensor, no distribution."""


def _writer(f: _Write) -> Callable[[Variable | torch.Tensor, VariableValue], object]:
    """``f`` as an ``extended.update`` function: it gets a component variable (or tensor) and a value."""

    def write(c: Variable | torch.Tensor, v: VariableValue) -> object:
        comp = c._components[0] if isinstance(c, Variable) else c
        return f(comp, _value_for(v, comp))

    return write


def component_variables(var: Variable) -> tuple[Variable, ...]:
    """Each component of ``var`` as a variable of its own (the same tensor, not a copy): what
    ``extended.update`` hands ``fn``, as TF hands it each component variable."""
    out = []
    for c in var.values:
        v = _LocalVariable.__new__(_LocalVariable)
        v._setup([c], var.synchronization, var.aggregation, var.trainable, var.name, var._strategy)
        out.append(v)
    return tuple(out)


def _new_local(
    value: torch.Tensor,
    sync: VariableSynchronization,
    agg: VariableAggregation,
    trainable: bool,
    name: str | None,
    device: torch.device | None = None,
    strategy: Strategy | None = None,
) -> Variable:
    v = object.__new__(_LocalVariable)
    if device is not None:
        value = value.to(device)
    v._setup((value,), sync, agg, trainable, name, strategy)
    return v


def _create_local_variable(
    ext: StrategyExtended,
    initial_value: torch.Tensor,
    synchronization: VariableSynchronization,
    aggregation: VariableAggregation,
    trainable: bool,
    name: str | None,
) -> Variable:
    return _new_local(
        initial_value,
        synchronization,
        aggregation,
        trainable,
        name,
        device=ext.worker_devices[0],
        strategy=ext._container_strategy(),
    )


# The distributed variables live in their own file; their names stay importable from here. Imported last:
# distributed_variables.py builds on Variable above.
from torchstrategies.distribute.distributed_variables import (  # noqa: E402
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    aggregation_error_msg,
    create_distributed_variable,
)
