"""Cross-process collectives on torch.distributed: SHM, RING, TREE, HIERARCHICAL, GLOO/NCCL.

Example (every rank, under torchrun):
    >>> import torch, torchstrategies as ts
    >>> from torchstrategies import collectives
    >>> x = torch.ones(4)                                                     # doctest: +SKIP
    >>> collectives.all_reduce_(x, op="sum", options=ts.CommunicationOptions(implementation="SHM"))
"""

from __future__ import annotations

from torchstrategies.collectives.api import (
    all_gather,
    all_reduce,
    all_reduce_,
    all_reduce_async,
    broadcast,
    buffer,
    choose,
)
from torchstrategies.collectives.options import CommunicationImplementation, CommunicationOptions

__all__ = [
    "CommunicationImplementation",
    "CommunicationOptions",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async",
    "broadcast",
    "buffer",
    "choose",
]
