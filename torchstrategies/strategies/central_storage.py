"""``CentralStorageStrategy``: variables once on the parameter device, computation replicated.

Example:
    >>> import torchstrategies as ts
    >>> s = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"], parameter_device="cpu")
    >>> s.num_replicas_in_sync
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from torchstrategies.distribute.cross_device_ops import CrossDeviceOps, ReductionToOneDevice
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.distribute_lib import Strategy
from torchstrategies.distribute.distributed_variables import create_distributed_variable
from torchstrategies.distribute.enums import VariableAggregation, VariableSynchronization
from torchstrategies.distribute.variables import Variable
from torchstrategies.strategies.mirrored import MirroredExtended, _default_devices
from torchstrategies.strategies.one_device import canonical_device

__all__ = ["CentralStorageStrategy"]


class CentralStorageExtended(MirroredExtended):
    @property
    def _reduce_device(self) -> torch.device:
        return self._variable_device

    def _create_variable(
        self, initial_value: torch.Tensor, synchronization: VariableSynchronization,
        aggregation: VariableAggregation, trainable: bool, name: str | None
    ) -> Variable:
        # ON_WRITE variables live once, on the parameter device; ON_READ ones keep a copy per replica.
        devices = None if synchronization == VariableSynchronization.ON_READ else (self._variable_device,)
        return create_distributed_variable(
            self, initial_value, synchronization, aggregation, trainable, name, devices=devices
        )


class CentralStorageStrategy(Strategy):
    """One copy of each variable on ``parameter_device``; replicas compute on ``compute_devices``.

    Each replica reads the current variable values onto its device (a per-step cache, not a second
    variable), gradients are summed on the parameter device (``ReductionToOneDevice(parameter_device)``)
    and the optimizer updates the single copy there.

    Args:
        compute_devices: device names; None: every GPU, else one CPU replica.
        parameter_device: where variables live; None: the CPU when there are several compute devices,
            else the single compute device (as TF).
        cross_device_ops: optional override of the reduction (extension; default ReductionToOneDevice to
            the parameter device).

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.CentralStorageStrategy(["cpu:0", "cpu:1"])
        >>> with s.scope():
        ...     w = torch.nn.Linear(2, 2).weight
        >>> w.device
        device(type='cpu')
    """

    def __init__(
        self,
        compute_devices: DeviceLike | Sequence[DeviceLike] | None = None,
        parameter_device: DeviceLike | None = None,
        *,
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        if compute_devices is None:
            compute_devices = _default_devices()
        if isinstance(compute_devices, (str, torch.device)):
            compute_devices = [compute_devices]
        compute_devices = list(compute_devices)
        if parameter_device is None:
            parameter_device = (
                "cpu:0" if len(compute_devices) > 1 else compute_devices[0] if compute_devices else "cpu"
            )
        pdev = canonical_device(parameter_device)[1]
        ops = cross_device_ops or ReductionToOneDevice(reduce_to_device=pdev)
        super().__init__(CentralStorageExtended(compute_devices, ops, parameter_device=parameter_device))

    def __repr__(self) -> str:
        ext = cast(CentralStorageExtended, self._extended)
        return (
            f"CentralStorageStrategy(compute_devices={list(ext._device_names)!r}, "
            f"parameter_device={str(ext._variable_device)!r})"
        )
