"""Descriptions that travel from the chief to the workers: where each variable's shards live."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["PsCall", "ShardSpec", "VarSpec", "split_rows"]

# One request to a ps task: ``(ps index, header, tensors) -> (reply header, reply tensors)``.
PsCall = Callable[[int, dict, list[torch.Tensor]], tuple[dict, list[torch.Tensor]]]


@dataclass(frozen=True)
class ShardSpec:
    ps: int          # index of the ps task holding the shard
    key: str         # "<var_id>/<shard index>"
    start: int       # first row (axis 0) of the full variable in this shard
    stop: int        # one past the last row


@dataclass
class VarSpec:
    var_id: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    shards: list[ShardSpec] = field(default_factory=list)
    embedding: bool = False      # the weight of an nn.Embedding (rows can be pulled/pushed alone)
    sparse: bool = False         # nn.Embedding(sparse=True): the ps applies row pushes as sparse gradients

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    @property
    def row_path(self) -> bool:
        """Whether workers move only touched rows (a sharded or sparse embedding table)."""
        return self.embedding and (self.sharded or self.sparse)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def split_rows(spec: VarSpec, ids: torch.Tensor) -> list[tuple[ShardSpec, torch.Tensor, torch.Tensor]]:
    """Splits sorted row ids of the full variable by shard: [(shard, positions in ids, local ids)]."""
    out = []
    if len(spec.shards) == 1:
        return [(spec.shards[0], torch.arange(ids.numel()), ids)]
    bounds = torch.tensor([s.start for s in spec.shards[1:]], dtype=ids.dtype)
    which = torch.bucketize(ids, bounds, right=True)
    for i, shard in enumerate(spec.shards):
        pos = (which == i).nonzero().reshape(-1)
        if pos.numel():
            out.append((shard, pos, ids.index_select(0, pos) - shard.start))
    return out
