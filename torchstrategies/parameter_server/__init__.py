"""The parameter server: ParameterServerStrategy, ClusterCoordinator and Server (asynchronous training that
survives failures). See docs/parameter_server.md.

Two layers; a module imports only from its own layer or a lower one, never back up:

**Training** (this folder), from the top:

* ``coordinator.py``: ``ClusterCoordinator`` schedules closures on the workers, one thread per worker,
  re-queues a lost worker's closure (``ts.coordinator`` re-exports its ``__all__``, the one list);
  ``closure_queue.py``: the queue and TF's error contract.
* ``strategy.py``: ``ParameterServerStrategy`` on the chief: connects to every task, heartbeats, ps failures;
  it tells its coordinator what happened through ``CoordinatorHooks`` and never imports it.
  ``worker_links.py``: ``WorkerLink``, the one record of which instance of each worker task (a restarted
  task is a new instance) the heartbeats and the coordinator's closures go to.
  ``base.py``: the hooks into the tf.distribute core (``ParameterServerExtended``).
* ``registry.py``: the chief's book (placement, ids of modules, optimizers, variables, datasets, iterators)
  and the closure pickler; ``closure_cache.py``: pickles a scheduled function once (it is given
  ``Registry.is_reference``, it does not import the registry).
* ``server.py``: ``Server``, what a ps or worker task runs: ``ps_service.py`` (a ps's shards and optimizers)
  or ``worker_runtime.py`` (a worker running closures against them; ``worker_channels.py``: its
  channels to the ps tasks).
* Values: ``remote_value.py`` (``RemoteValue``, ``PerWorkerValues``), ``per_worker_input.py`` (per-worker
  datasets and iterators, what ``dataset_fn`` is told), ``variables.py`` (``PSVariable``), ``specs.py``
  (where a variable's shards live).

**rpc/**: the gRPC layer. It moves bytes between tasks and authenticates them, and knows nothing of what
they mean (it imports nothing from the training layer): ``wire.py`` (the versioned message schema),
``auth.py`` (job secret, mutual TLS, signatures), ``session.py`` (the handshake and single-use MACs),
``streams.py`` (pooled bidirectional streams), ``transport.py`` (the services and the server side),
``client.py`` (the client side, one channel per pair of tasks), ``rendezvous.py`` (signed, fresh addresses
in a TCPStore). A file belongs in rpc/ if it would serve any other service unchanged.
"""

from torchstrategies.parameter_server.server import Server
from torchstrategies.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ParameterServerStrategy", "Server"]
