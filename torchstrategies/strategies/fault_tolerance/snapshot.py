"""What a discarded step gives back: the model's buffers and the random states as they were when the attempt
began. ``TransactionalLoop`` takes a :class:`StepSnapshot` before each attempt of a step and restores it when
the attempt is discarded. The buffers are copied into tensors kept from step to step (made again only when
the model's buffers change: another tensor, shape, dtype or device), so a step allocates nothing for them.
"""

from __future__ import annotations

import torch

from torchstrategies.strategies.fault_tolerance.random_states import RandomStates

__all__ = ["StepSnapshot"]


class StepSnapshot:
    """The model's buffers and the random states at the start of an attempt (:meth:`take`), to put back
    (:meth:`restore`).

    Args:
        model: the module whose buffers a step may change (BatchNorm's running statistics).
        device: the worker's device (its CUDA generator is part of the random states).

    Example:
        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> snapshot = StepSnapshot(bn, torch.device("cpu"))
        >>> snapshot.take()
        >>> _ = bn(torch.randn(4, 2)), torch.rand(())
        >>> snapshot.restore()
        >>> int(bn.num_batches_tracked)
        0
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._model, self._device = model, device
        self._buffers: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        self._random: RandomStates | None = None

    def take(self) -> None:
        buffers = list(self._model.buffers())
        with torch.no_grad():
            if len(buffers) != len(self._buffers) or any(
                    b is not k or b.shape != c.shape or b.dtype != c.dtype or b.device != c.device
                    for b, k, c in zip(buffers, self._buffers, self._copies)):
                self._buffers, self._copies = buffers, [b.detach().clone() for b in buffers]
            else:
                for b, c in zip(buffers, self._copies):
                    c.copy_(b)
        self._random = RandomStates(self._device)

    def restore(self) -> None:
        """Puts back the buffers' values and the random states of the last :meth:`take`."""
        assert self._random is not None, "restore() before take()"
        with torch.no_grad():
            for b, c in zip(self._buffers, self._copies):
                b.copy_(c)
        self._random.restore()
