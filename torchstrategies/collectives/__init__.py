"""Cross-process collectives: the torch.distributed backend "torchstrategies" (shared memory inside a host,
the C++ TCP ring between hosts) and one interface over process groups on it, gloo or NCCL.

Example (every rank, under torchrun):
    >>> import torch, torch.distributed as dist, torchstrategies as ts
    >>> from torchstrategies import collectives
    >>> dist.init_process_group("torchstrategies")                            # doctest: +SKIP
    >>> x = torch.ones(4)                                                     # doctest: +SKIP
    >>> dist.all_reduce(x)                                                    # doctest: +SKIP
    >>> collectives.all_reduce_(x, op="mean")                                 # doctest: +SKIP
    >>> g = collectives.new_group(ts.CommunicationOptions(implementation="RING"))  # doctest: +SKIP
"""

from __future__ import annotations

from torchstrategies.collectives._common import from_backend_error
from torchstrategies.collectives.api import (
    all_gather,
    all_reduce,
    all_reduce_,
    all_reduce_async,
    broadcast,
    buffer,
    choose,
    new_group,
)
from torchstrategies.collectives.backend import BACKEND, BackendOptions, register
from torchstrategies.collectives.options import CommunicationImplementation, CommunicationOptions

register()  # dist.init_process_group("torchstrategies") works once torchstrategies is imported

__all__ = [
    "BACKEND",
    "BackendOptions",
    "CommunicationImplementation",
    "CommunicationOptions",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async",
    "broadcast",
    "buffer",
    "choose",
    "from_backend_error",
    "new_group",
]
