"""Loss helpers: ``compute_average_loss`` and ``scale_regularization_loss`` (TF's ``tf.nn`` versions).

Gradients are SUMMED across replicas, so each replica's loss is divided by the GLOBAL batch size.

Example:
    >>> import torch, torchstrategies as ts
    >>> ts.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    tensor(1.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchstrategies.distribute import context
from torchstrategies.reduce_op import ReduceOp

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: torch.Tensor | Sequence[float],
    sample_weight: torch.Tensor | float | Sequence[float] | None = None,
    global_batch_size: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum(per_example_loss * sample_weight) / global_batch_size``, for use inside ``strategy.run``.

    When ``global_batch_size`` is None it is the true number of examples in this step across all
    replicas: the replicas' batch sizes are all-reduced (so uneven and empty replica batches give the
    exact global mean; every replica must call it, as with any all-reduce). An empty batch gives 0.

    Args:
        per_example_loss: per-example losses, rank >= 1 (dim 0 is the batch).
        sample_weight: optional weights; as in TF, a weight of shape ``(batch, 1)`` for a loss of shape
            ``(batch,)`` is squeezed, one a rank lower gets a last dim of 1, then they broadcast.
        global_batch_size: optional positive integer.

    Raises:
        ValueError: ``per_example_loss`` is a scalar, ``sample_weight`` does not fit its shape (TF's
            squeeze/expand of the last dim, then broadcasting), or ``global_batch_size`` is not a scalar or
            not positive (TF raises its InvalidArgumentError for the last two).
        TypeError: ``global_batch_size`` is not an integer (e.g. 2.5), as TF's ``assert_integer``.
        RuntimeError: called in cross-replica context with ``global_batch_size`` None.
    """
    loss = _weighted_loss(per_example_loss, sample_weight)
    if global_batch_size is None:
        count = _global_batch_size(loss)
        if count == 0:
            return loss.sum() * 0.0
    elif (
        type(global_batch_size) is int
        and global_batch_size > 0
        and loss.dtype in (torch.float32, torch.float64)
        and global_batch_size < 2**24
    ):  # exact as a Python scalar: the same division, without building a tensor
        return loss.sum() / global_batch_size
    else:
        count = _checked_batch_size(global_batch_size)
    return loss.sum() / torch.as_tensor(count, dtype=loss.dtype, device=loss.device)


def _weighted_loss(
    per_example_loss: torch.Tensor | Sequence[float], sample_weight: torch.Tensor | float | Sequence[float] | None
) -> torch.Tensor:
    """``per_example_loss`` as a tensor of rank >= 1, times ``sample_weight`` (TF's shape rules), in the
    loss's dtype."""
    loss = per_example_loss if isinstance(per_example_loss, torch.Tensor) else torch.as_tensor(per_example_loss)
    if loss.dim() < 1:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1, got a "
            "scalar "
            f"{loss!r}"
        )
    if sample_weight is None:
        return loss
    weight = _match_weight_rank(torch.as_tensor(sample_weight, device=loss.device), loss)
    try:
        torch.broadcast_shapes(weight.shape, loss.shape)
    except RuntimeError as e:
        raise ValueError(
            f"sample_weight of shape {tuple(weight.shape)} does not broadcast to per_example_loss of "
            f"shape {tuple(loss.shape)}"
        ) from e
    return (loss * weight).to(loss.dtype)


def _global_batch_size(loss: torch.Tensor) -> int:
    """The number of examples in this step over every replica: the replicas' batch sizes all-reduced."""
    if context.has_strategy() and context.in_cross_replica_context():
        raise RuntimeError(
            "You are calling `compute_average_loss` in cross replica context, while it was expected to "
            "be "
            "called in replica context."
        )
    strategy = context.get_strategy()
    ctx = context.get_replica_context()
    local = loss.shape[0]
    if strategy.num_replicas_in_sync > 1 and ctx is not None:
        count = ctx.all_reduce(ReduceOp.SUM, torch.tensor(float(local), dtype=torch.float64))
        return int(round(float(count)))
    return local


def _checked_batch_size(global_batch_size: object) -> int:
    """A given ``global_batch_size`` as a positive int; TF's errors for anything else."""
    try:
        gbs = torch.as_tensor(global_batch_size)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(
            f'global_batch_size must be an integer. Expected "x" to be integer type.  Found: '
            f"{global_batch_size!r} of type {type(global_batch_size).__name__}"
        ) from e
    if gbs.dim() != 0:
        raise ValueError(
            f"global_batch_size must be scalar. Expected scalar shape, saw shape: {tuple(gbs.shape)} "
            f"({global_batch_size!r})"
        )
    if gbs.is_floating_point() or gbs.is_complex() or gbs.dtype == torch.bool:
        raise TypeError(
            f'global_batch_size must be an integer. Expected "x" to be integer type.  Found: '
            f"{global_batch_size!r} of dtype {gbs.dtype}"
        )
    if int(gbs) <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size!r}")
    return int(gbs)


def _match_weight_rank(weight: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """TF's ``squeeze_or_expand_dimensions``: a weight one rank above the loss loses its last dim (which
    must be 1); one rank below gains a last dim of 1; a scalar stays a scalar."""
    if weight.dim() == 0:
        return weight
    diff = weight.dim() - loss.dim()
    if diff == 1:
        if weight.shape[-1] != 1:
            raise ValueError(
                f"Can not squeeze dim[{weight.dim() - 1}], expected a dimension of 1, got "
                f"{weight.shape[-1]}: sample_weight of shape {tuple(weight.shape)} for per_example_loss of "
                f"shape {tuple(loss.shape)}"
            )
        return weight.squeeze(-1)
    if diff == -1:
        return weight.unsqueeze(-1)
    return weight


def scale_regularization_loss(regularization_loss: torch.Tensor | float | Sequence[float]) -> torch.Tensor:
    """``sum(regularization_loss) / num_replicas_in_sync`` (inside ``strategy.run``).

    Raises:
        RuntimeError: called in cross-replica context.
    """
    if context.has_strategy() and context.in_cross_replica_context():
        raise RuntimeError(
            "You are calling `scale_regularization_loss` in cross replica context, while it was expected to "
            "be called in replica context."
        )
    n = context.get_strategy().num_replicas_in_sync
    return torch.as_tensor(regularization_loss).sum() / n
