"""ParameterServerStrategy, ClusterCoordinator and Server: asynchronous training that survives failures.

See docs/parameter_server.md. Layout: ``strategy.py`` (the chief's strategy and scope), ``registry.py``
(placement, module/optimizer references), ``coordinator.py`` + ``closure_queue.py`` (scheduling, TF's error
contract), ``remote_value.py``, ``server.py`` (ps/worker tasks), ``ps_service.py`` (a ps's shards and
optimizers), ``worker_runtime.py`` (pull/compute/push on a worker), ``transport.py`` (gRPC services and the
server side, one channel per pair of tasks), ``client.py`` (the client side), ``rendezvous.py`` (signed, fresh
addresses in a TCPStore), ``wire.py`` (the versioned message schema), ``auth.py`` (job secret, mutual TLS,
signatures), ``session.py`` (the handshake and single-use MACs).
"""

from torchstrategies.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerDataset,
    PerWorkerDatasetIterator,
)
from torchstrategies.parameter_server.remote_value import (
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)
from torchstrategies.parameter_server.server import Server
from torchstrategies.parameter_server.strategy import ParameterServerStrategy

__all__ = [
    "ClusterCoordinator",
    "ParameterServerStrategy",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "Server",
]
