"""Device names: TF's (``"/gpu:1"``, ``"/job:localhost/replica:0/task:0/device:CPU:0"``) and torch's.

The one place that turns a device name into a ``torch.device`` (TF's ``device_util.resolve``). Strategy
constructors, ``extended.reduce_to`` / ``batch_reduce_to`` destinations and ``ReductionToOneDevice``'s
``reduce_to_device`` all accept the same names. Every CPU name places on torch's one ``cpu`` device;
``GPU`` is torch's ``cuda``. A TF name may carry only this process's job, replica and task
(``/job:localhost/replica:0/task:0``): a device of another task cannot be placed on from here.

Example:
    >>> from torchstrategies.distribute.device_util import canonicalize, resolve
    >>> canonicalize("/job:localhost/replica:0/task:0/device:GPU:1")
    ('cuda:1', device(type='cuda', index=1))
    >>> resolve("/cpu:0")
    device(type='cpu')
"""

from __future__ import annotations

from typing import TypeAlias

import torch

__all__ = ["DeviceLike", "canonicalize", "resolve"]

DeviceLike: TypeAlias = "str | torch.device"
"""A device name (torch's or TF's) or a ``torch.device``."""

_KINDS = ("cpu", "cuda", "mps", "xpu", "meta")
_THIS_TASK = {"job": "localhost", "replica": "0", "task": "0"}


def _invalid(name: object, why: str) -> ValueError:
    return ValueError(
        f"Invalid device {name!r}: {why}; expected a device such as 'cpu:0', 'cuda:1', '/gpu:1' or "
        "'/job:localhost/replica:0/task:0/device:CPU:0'"
    )


def canonicalize(name: DeviceLike) -> tuple[str, torch.device]:
    """Normalizes a TF- or torch-style device name.

    Args:
        name: a ``torch.device`` or a string: ``"cpu"``, ``"cuda:1"``, ``"/gpu:0"``, ``"/device:CPU:0"``,
            ``"GPU:1"``, ``"/job:localhost/replica:0/task:0/device:GPU:1"``.

    Returns:
        (normalized name such as ``"cuda:1"``, the ``torch.device`` to place on; every CPU name places on
        ``cpu``).

    Raises:
        ValueError: not a device name, or a TF name of another job, replica or task.
    """
    if isinstance(name, torch.device):
        text = str(name)
    elif isinstance(name, str):
        text = name.strip()
    else:
        raise _invalid(name, f"a {type(name).__name__} is not a device name")
    kind = index = None
    for part in (p for p in text.split("/") if p):
        key, _, rest = part.partition(":")
        key = key.lower()
        if key in _THIS_TASK:
            if rest.lower() != _THIS_TASK[key]:
                raise _invalid(
                    name,
                    f"only this process's devices can be named ({key} must be "
                    f"{_THIS_TASK[key]!r}, got {rest!r})",
                )
            continue
        if kind is not None:
            raise _invalid(name, "it names two devices")
        if key == "device":
            key, _, rest = rest.partition(":")
            key = key.lower()
        kind = "cuda" if key == "gpu" else key
        index = rest
    if kind is None:
        raise _invalid(name, "no device type")
    if kind not in _KINDS or (index and not index.isdigit()):
        raise _invalid(name, f"unknown device type or index {kind!r}:{index!r}")
    idx = int(index) if index else 0
    placement = torch.device("cpu") if kind == "cpu" else torch.device(kind, idx)
    return f"{kind}:{idx}", placement


def resolve(device: DeviceLike) -> torch.device:
    """The ``torch.device`` for a device name (a ``torch.device`` is returned as it is).

    Raises:
        ValueError: not a device name (see :func:`canonicalize`).
    """
    if isinstance(device, torch.device):
        return device
    return canonicalize(device)[1]
