"""``ts.coordinator``: the cluster coordinator of ParameterServerStrategy (``tf.distribute.coordinator``).

Example:
    >>> import torchstrategies as ts
    >>> ts.coordinator.ClusterCoordinator.__name__
    'ClusterCoordinator'
"""

from torchstrategies.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerDataset,
    PerWorkerDatasetIterator,
)
from torchstrategies.parameter_server.per_worker_input import PerWorkerInputContext
from torchstrategies.parameter_server.remote_value import (
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerInputContext",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
]
