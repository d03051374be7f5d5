"""The model the training benchmarks train (``bench train``, ``bench train-ps``, ``bench inproc``).

Example:
    >>> from torchstrategies.bench.mlp import SIZES, mlp
    >>> [m.out_features for m in mlp(SIZES) if hasattr(m, "out_features")]
    [1024, 1024, 10]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SIZES", "mlp"]

SIZES = (784, 1024, 1024, 10)


def mlp(sizes: Sequence[int] = SIZES) -> torch.nn.Sequential:
    """Linear layers of the given widths with a ReLU between each two (none after the last)."""
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])
