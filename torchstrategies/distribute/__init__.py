"""The tf.distribute core: contexts, Strategy/StrategyExtended, values, variables, input, loss helpers."""

from __future__ import annotations

from torchstrategies.distribute.buffers import declare_buffer_aggregation
from torchstrategies.distribute.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from torchstrategies.distribute.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from torchstrategies.distribute.distribute_lib import (
    ReplicaContext,
    Strategy,
    StrategyExtended,
    ValueContext,
)
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization
from torchstrategies.distribute.input_lib import InputContext, InputOptions
from torchstrategies.distribute.loss import compute_average_loss, scale_regularization_loss
from torchstrategies.distribute.replica_share import linear_gradient_hook
from torchstrategies.distribute.values import DistributedValues, Mirrored, PerReplica
from torchstrategies.distribute.variables import Variable

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "compute_average_loss",
    "declare_buffer_aggregation",
    "linear_gradient_hook",
    "scale_regularization_loss",
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
