"""The distributed ``ts.Variable``: one component per local replica, with TF's synchronization rules.

``MirroredVariable`` (ON_WRITE: replica-context writes aggregated through ``merge_call``, written everywhere)
and ``SyncOnReadVariable`` (ON_READ: each replica its own component, a cross-replica read aggregates), made
by :func:`create_distributed_variable` for the strategies with several local replicas (Mirrored,
CentralStorage). ``distribute/variables.py`` holds the ``Variable`` they share (reads, writes, operators)
and re-exports these names; its docstring states the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from torchstrategies.distribute import context
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization, reduce_op_for
from torchstrategies.distribute.values import DistributedValues, PerReplica, local_results
from torchstrategies.distribute.variables import Variable, VariableValue, _value_for, _Write, _writer

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.distribute.cross_device_ops import CrossDeviceOps
    from torchstrategies.distribute.distribute_lib import Strategy, StrategyExtended

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable", "create_distributed_variable",
           "aggregation_error_msg"]


class _InProcessExtended(Protocol):
    """What a SyncOnReadVariable's cross-replica read needs of its strategy (MirroredExtended has it)."""

    _cross_device_ops: CrossDeviceOps

aggregation_error_msg = (
    "You must specify an aggregation method to update a {variable_type} in Replica Context. You can do so by "
    "passing an explicit value for argument `aggregation` to ts.Variable(..), e.g. "
    "`ts.Variable(..., aggregation=ts.VariableAggregation.SUM)`. This is required because {variable_type} "
    "should always be kept in sync. Another alternative is to update it in cross replica context: call "
    "`ts.get_replica_context().merge_call(merge_fn, ..)` and inside `merge_fn` use "
    "`strategy.extended.update()`."
)


def _replica_id(var: DistributedVariable) -> int | None:
    mode = context.current_mode()
    rc = mode.replica_context
    if rc is None or mode.cross_replica is not None or mode.is_default or rc.strategy is not var._strategy:
        return None
    return rc._local_replica_id


class DistributedVariable(Variable):
    """A variable with one component per local replica (base of Mirrored/SyncOnRead variables)."""

    _strategy: Strategy  # always set (``create_distributed_variable``)

    def _read(self) -> torch.Tensor:
        i = _replica_id(self)
        return self._components[0 if i is None or len(self._components) == 1 else i]


class MirroredVariable(DistributedVariable):
    """ON_WRITE: every component holds the same value; replica-context writes are aggregated."""

    def _write(self, op: str, f: _Write, value: VariableValue) -> Variable:
        strategy = self._strategy
        i = _replica_id(self)
        if i is None:
            context_strategy = context.get_strategy()
            if context.has_strategy() and context_strategy is not strategy:
                raise RuntimeError(
                    f"Mixing different tf.distribute.Strategy objects: {context_strategy} is not {strategy}"
                )
            with strategy.scope():
                strategy.extended.update(self, _writer(f), args=(value,))
            return self
        if self.aggregation == VariableAggregation.NONE:
            if len(self._components) == 1 and strategy.extended._num_local_replicas > 1:
                # One copy that every replica shares (CentralStorage): TF's AggregatingVariable refuses.
                raise ValueError(aggregation_error_msg.format(variable_type="AggregatingVariable"))
            # TF 2.x: each replica writes its own component; the components may diverge.
            comp = self._components[i if len(self._components) > 1 else 0]
            with torch.no_grad():
                f(comp, _value_for(value, comp))
            return self
        agg = self.aggregation

        def merge_fn(strategy: Strategy, v: DistributedValues[VariableValue] | VariableValue) -> None:
            reduced = _apply_aggregation(strategy, v, agg, self)
            strategy.extended.update(self, _writer(f), args=(reduced,))
            return None

        context.get_replica_context().merge_call(merge_fn, args=(value,))  # type: ignore[union-attr]
        return self


def _no_reduce_op_msg(agg: VariableAggregation) -> str:
    return (
        f"Could not convert from `tf.VariableAggregation` {agg} to`tf.distribute.ReduceOp` type (a "
        "SyncOnReadVariable with aggregation NONE has no value in cross-replica context: read, assign, "
        "assign_add and assign_sub need one; write it inside `strategy.run`, or give it an aggregation)"
    )


def _apply_aggregation(
    strategy: Strategy,
    value: DistributedValues[VariableValue] | VariableValue,
    agg: VariableAggregation,
    destinations: Variable,
) -> Any:
    if agg == VariableAggregation.ONLY_FIRST_REPLICA:
        first = local_results(value)[0]
        return first
    value = (
        value
        if isinstance(value, DistributedValues)
        else (value if not isinstance(value, Variable) else value.read_value())
    )
    if isinstance(value, DistributedValues):
        value = PerReplica(tuple(torch.as_tensor(c) for c in value.values))
    return strategy.extended.reduce_to(reduce_op_for(agg), value, destinations._components[0].device)


class SyncOnReadVariable(DistributedVariable):
    """ON_READ: each replica writes its own component; a cross-replica read aggregates them."""

    def _read(self) -> torch.Tensor:
        i = _replica_id(self)
        if i is not None:
            return self._components[i]
        agg = self.aggregation
        if agg == VariableAggregation.ONLY_FIRST_REPLICA or len(self._components) == 1:
            return self._components[0]
        if agg == VariableAggregation.NONE:
            raise ValueError(_no_reduce_op_msg(agg))
        # Only the in-process strategies (MirroredExtended) make SyncOnRead variables.
        ext = cast(_InProcessExtended, self._strategy.extended)
        return ext._cross_device_ops.reduce(
            reduce_op_for(agg), PerReplica(self._components), self._components[0].device
        )

    def _cross_replica_check(self, op: str) -> None:
        if self.aggregation == VariableAggregation.NONE and len(self._components) > 1:
            # TF writes every component, then fails reading the result back; we refuse before writing.
            raise ValueError(_no_reduce_op_msg(self.aggregation))
        if op != "assign" and self.aggregation == VariableAggregation.SUM:
            raise ValueError(
                f"SyncOnReadVariable does not support `{op}` in cross-replica context when aggregation is "
                "set to "
                "`tf.VariableAggregation.SUM`."
            )

    def _write(self, op: str, write: _Write, value: VariableValue) -> Variable:
        i = _replica_id(self)
        with torch.no_grad():
            if i is not None:
                write(self._components[i], _value_for(value, self._components[i]))
                return self
            self._cross_replica_check(op)
            for c in self._components:
                v = _value_for(value, c)
                if op == "assign" and self.aggregation == VariableAggregation.SUM:
                    v = (v / len(self._components)).to(c.dtype)  # the components sum back to ``value``
                write(c, v)
        return self


def create_distributed_variable(
    ext: StrategyExtended,
    initial_value: torch.Tensor,
    sync: VariableSynchronization,
    agg: VariableAggregation,
    trainable: bool,
    name: str | None,
    devices: Sequence[torch.device] | None = None,
) -> Variable:
    """Creates a Mirrored/SyncOnRead variable with one component per local replica of ``ext``.

    ``devices`` overrides where the components live (CentralStorage keeps ON_WRITE variables as ONE
    component on the parameter device, which every replica reads).
    """
    if sync == VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please "
            "change the "
            f"`synchronization` for variable: {name}"
        )
    if agg == VariableAggregation.MEAN and not (
        initial_value.is_floating_point() or initial_value.is_complex()
    ):
        raise ValueError(
            f"VariableAggregation.MEAN is not supported for the integer variable {name!r} (dtype "
            f"{initial_value.dtype}): the mean of integers is not an integer; use SUM or ONLY_FIRST_REPLICA"
        )
    comps = tuple(initial_value.to(d, copy=True) for d in (devices or ext.worker_devices))
    cls = SyncOnReadVariable if sync == VariableSynchronization.ON_READ else MirroredVariable
    v = object.__new__(cls)
    v._setup(comps, sync, agg, trainable, name, ext._container_strategy())
    return v
