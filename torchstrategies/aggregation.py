"""``AggregationMethod``: which kernel sums N same-shaped tensors.

In TensorFlow, ``tf.AggregationMethod`` chooses how the gradient terms of one tensor are summed inside
``tf.gradients``. Here it chooses the kernel that sums N same-shaped tensors (replica gradients, peer
buffers): ADD_N = sequential torch adds, EXPERIMENTAL_TREE = our pairwise-order one-pass kernel (smaller
rounding error), EXPERIMENTAL_ACCUMULATE_N = our fused one-pass kernel.

Example:
    >>> import torch, torchstrategies as ts
    >>> ts.aggregate([torch.ones(3), torch.ones(3)], ts.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N)
    tensor([2., 2., 2.])
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from torchstrategies import ops
from torchstrategies._enum_names import member

__all__ = ["AggregationMethod", "aggregate"]


class AggregationMethod(enum.IntEnum):
    """Kernel used to sum N same-shaped tensors (values as in ``tf.AggregationMethod``)."""

    ADD_N = 0
    EXPERIMENTAL_TREE = 1
    EXPERIMENTAL_ACCUMULATE_N = 2
    DEFAULT = 0  # alias of ADD_N, as in TF


def _resolve(method: object) -> AggregationMethod:
    found = AggregationMethod.DEFAULT if method is None else member(AggregationMethod, method)
    if found is not None:
        return found
    if isinstance(method, int) and not isinstance(method, bool):
        try:
            return AggregationMethod(method)
        except ValueError:
            pass
    raise ValueError(f"Invalid aggregation_method specified {method!r}.")


def aggregate(
    tensors: Sequence[torch.Tensor],
    method: AggregationMethod | str | int | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Sums same-shaped ``tensors`` with the kernel ``method`` picks, times ``scale`` if given.

    Args:
        tensors: the tensors to sum (same shape, dtype and device).
        method: an ``AggregationMethod`` (or its name / value); None means DEFAULT (ADD_N).
        out: optional output tensor, may alias ``tensors[0]``.
        scale: optional factor, e.g. ``1/N`` for a mean.

    Returns:
        The sum (``out`` if given).

    Raises:
        ValueError: ``method`` is not an AggregationMethod ("Invalid aggregation_method specified").
    """
    m = _resolve(method)
    if m == AggregationMethod.EXPERIMENTAL_ACCUMULATE_N:
        return ops.accumulate_n(tensors, out=out, scale=scale)
    if m == AggregationMethod.EXPERIMENTAL_TREE:
        return ops.tree_reduce(tensors, out=out, scale=scale)
    items = ops._as_list("aggregate", tensors)
    scale = ops._check_scale("aggregate", scale, items)
    if out is not None:
        ops._check_same("aggregate", items, out)  # copy_ below would broadcast a wrong-shaped out
    result = ops.add_n(items)
    if scale is not None:
        result.mul_(scale)
    if out is not None:
        out.copy_(result)
        return out
    return result
