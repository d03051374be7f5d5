"""The fault-tolerant mode of MultiWorkerMirrored training (docs/fault_tolerance.md).

* ``options.py``: ``FaultTolerance``, the mode's options.
* ``membership.py``: generations and the joiners, in the launcher's TCPStore (a step's path never touches it).
* ``state_transfer.py``: a live member's state sent to a returning one (tensors and a JSON header).
* ``global_batches.py``: ``GlobalBatches``, the fixed sequence of global batches split among the members.
* ``loop.py``: ``TransactionalLoop``, the user's ``step_fn`` as a transaction (commit point: the end of backward).
* ``random_states.py``: torch's, CUDA's, Python's and numpy's random states, given back on abort and healed.
* ``snapshot.py``: ``StepSnapshot``, the buffers and random states a discarded attempt gives back.
* ``group.py``: each generation's group, the step's flat buffers, and its all-reduces (``CollectiveFailed``).
* ``strategy.py``: ``FaultTolerantMultiWorkerMirroredStrategy``.
* ``launch.py``: the launcher that hosts the store and restarts each worker alone.
"""

from torchstrategies.strategies.fault_tolerance.global_batches import GlobalBatches
from torchstrategies.strategies.fault_tolerance.loop import TransactionalLoop
from torchstrategies.strategies.fault_tolerance.options import FaultTolerance
from torchstrategies.strategies.fault_tolerance.strategy import (
    FaultTolerantExtended,
    FaultTolerantMultiWorkerMirroredStrategy,
)

__all__ = ["FaultTolerance", "FaultTolerantMultiWorkerMirroredStrategy", "FaultTolerantExtended", "GlobalBatches",
           "TransactionalLoop"]
