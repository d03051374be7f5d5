"""torchstrategies: TensorFlow's tf.distribute strategies for PyTorch.

Example:
    >>> import torch, torchstrategies as ts
    >>> ts.ops.accumulate_n([torch.ones(2), torch.ones(2)])
    tensor([2., 2.])
"""

from __future__ import annotations

from torchstrategies import _logging  # noqa: F401  (sets up the "torchstrategies" logger)
from torchstrategies import _ext  # noqa: F401  (fails with build instructions if _C is missing)
from torchstrategies import cluster_resolver, errors, ops
from torchstrategies.aggregation import AggregationMethod, aggregate
from torchstrategies.reduce_op import ReduceOp

__version__ = "0.1.0"

__all__ = [
    "AggregationMethod",
    "ReduceOp",
    "aggregate",
    "cluster_resolver",
    "errors",
    "ops",
    "__version__",
]
from torchstrategies import distribute  # noqa: E402
from torchstrategies.distribute import *  # noqa: E402, F403  (the tf.distribute names, listed once there)

__all__ += ["distribute", *distribute.__all__]
from torchstrategies.strategies import (  # noqa: E402
    CentralStorageStrategy,
    MirroredStrategy,
    OneDeviceStrategy,
)

__all__ += ["CentralStorageStrategy", "MirroredStrategy", "OneDeviceStrategy"]
from torchstrategies import collectives  # noqa: E402
from torchstrategies.collectives.options import CommunicationImplementation, CommunicationOptions  # noqa: E402

__all__ += ["CommunicationImplementation", "CommunicationOptions", "collectives"]
from torchstrategies import checkpoint  # noqa: E402
from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy  # noqa: E402

__all__ += ["MultiWorkerMirroredStrategy", "checkpoint"]
# The fault-tolerant mode of MultiWorkerMirrored (issue 48).
from torchstrategies.strategies.fault_tolerance import (  # noqa: E402
    FaultTolerance,
    FaultTolerantMultiWorkerMirroredStrategy,
    GlobalBatches,
)

__all__ += ["FaultTolerance", "FaultTolerantMultiWorkerMirroredStrategy", "GlobalBatches"]

# ParameterServerStrategy (issue 6): ts.ParameterServerStrategy, ts.coordinator, ts.partitioners.
from torchstrategies import coordinator, partitioners  # noqa: E402
from torchstrategies.parameter_server import ParameterServerStrategy, Server  # noqa: E402

distribute.Server = Server  # type: ignore[attr-defined]  # ts.distribute.Server (TF's tf.distribute.Server): what ps and worker tasks run
__all__ += ["ParameterServerStrategy", "coordinator", "partitioners"]

# ts.nn (issue 12): SyncBatchNorm over the replicas of the current strategy.
from torchstrategies import nn  # noqa: E402

__all__ += ["nn"]
