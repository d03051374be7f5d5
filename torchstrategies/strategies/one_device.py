"""``OneDeviceStrategy``: everything on one device, one replica (``tf.distribute.OneDeviceStrategy``).

Example:
    >>> import torch, torchstrategies as ts
    >>> s = ts.OneDeviceStrategy("cpu")
    >>> with s.scope():
    ...     model = torch.nn.Linear(3, 1)
    >>> s.num_replicas_in_sync
    1
"""

from __future__ import annotations

from typing import cast

import torch

from torchstrategies.distribute import device_util
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.distribute_lib import Strategy, StrategyExtended

__all__ = ["OneDeviceStrategy"]


def canonical_device(name: DeviceLike, must_exist: bool = False) -> tuple[str, torch.device]:
    """Normalizes TF- or torch-style device names ("/gpu:0", "/device:CPU:0", "cuda:1", "cpu").

    Args:
        name: the device name (or a torch.device).
        must_exist: also check that the device exists on this machine (strategy constructors do, so a
            wrong device fails when the strategy is built, not at first use).

    Returns:
        (normalized name, torch.device used for placement; every CPU name places on ``cpu``).

    Raises:
        ValueError: not a device name, or (``must_exist``) a device this machine does not have.
    """
    normalized, placement = device_util.canonicalize(name)
    if must_exist and placement.type == "cuda":
        index = placement.index or 0
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            have = "no CUDA device" if count == 0 else f"{count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            raise ValueError(
                f"Device {name!r} does not exist: this machine has {have}. Pick an existing device, e.g. "
                f"'cpu:0'{'' if count == 0 else ' or cuda:0'}, or launch where the GPU is visible "
                "(check CUDA_VISIBLE_DEVICES)"
            )
    return normalized, placement


class OneDeviceExtended(StrategyExtended):
    def __init__(self, device: DeviceLike):
        super().__init__()
        self._device_name, dev = canonical_device(device, must_exist=True)
        self._worker_devices = (dev,)

    def _create_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        dev = self._worker_devices[0]
        if param.device == dev:
            return None
        return torch.nn.Parameter(param.detach().to(dev), requires_grad=param.requires_grad)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor) -> torch.Tensor | None:
        dev = self._worker_devices[0]
        return None if buffer.device == dev else buffer.to(dev)


class OneDeviceStrategy(Strategy):
    """Places variables and computation on ``device``; ``run`` calls ``fn`` once.

    Args:
        device: e.g. ``"cpu"``, ``"cuda:0"`` or TF's ``"/gpu:0"``.

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.OneDeviceStrategy("/cpu:0")
        >>> s.run(lambda x: x * 2, args=(torch.tensor(2.0),))
        tensor(4.)
    """

    def __init__(self, device: DeviceLike):
        super().__init__(OneDeviceExtended(device))

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={cast(OneDeviceExtended, self._extended)._device_name!r})"
