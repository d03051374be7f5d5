"""The public API of ``torchstrategies``: what ``import torchstrategies`` puts in the package (through
``torchstrategies.load_api()``). Imported in this order: the extension first (it fails with build
instructions if ``_C`` is missing), then the layers bottom up.
"""

from __future__ import annotations

from torchstrategies import _ext  # noqa: F401  (fails with build instructions if _C is missing)
from torchstrategies import cluster_resolver, errors, ops
from torchstrategies.aggregation import AggregationMethod, aggregate
from torchstrategies.reduce_op import ReduceOp

__all__ = [
    "AggregationMethod",
    "ReduceOp",
    "aggregate",
    "cluster_resolver",
    "errors",
    "ops",
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

# ParameterServerStrategy (issue 6): ts.ParameterServerStrategy, ts.coordinator, ts.partitioners.
from torchstrategies import coordinator, partitioners  # noqa: E402
from torchstrategies.parameter_server import ParameterServerStrategy, Server  # noqa: E402

distribute.Server = Server  # type: ignore[attr-defined]  # ts.distribute.Server (TF's tf.distribute.Server): what ps and worker tasks run
__all__ += ["ParameterServerStrategy", "coordinator", "partitioners"]

# ts.nn (issue 12): SyncBatchNorm over the replicas of the current strategy.
from torchstrategies import nn  # noqa: E402

__all__ += ["nn"]
