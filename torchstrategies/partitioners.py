"""Variable partitioners: how many row shards a large parameter is split into
(``tf.distribute.experimental.partitioners``).

A partitioner is called with a parameter's ``shape`` (a ``torch.Size``) and ``dtype`` and returns a list with
one entry per axis: how many shards along that axis. Only axis 0 is ever split, as in TensorFlow, so the
result is ``[k, 1, 1, ...]``. ``ParameterServerStrategy(variable_partitioner=...)`` applies it to every
parameter of rank >= 1 created under its ``scope()``; ``k > 1`` splits the parameter into ``k`` contiguous row
shards placed on the parameter servers round-robin. When ``shape[0]`` does not divide evenly, the first
``shape[0] % k`` shards are one row larger (13 rows over 5 shards -> 3, 3, 3, 2, 2), TF's rule.

Example:
    >>> import torch
    >>> from torchstrategies.partitioners import FixedShardsPartitioner, shard_sizes
    >>> FixedShardsPartitioner(5)(torch.Size([13, 4]), torch.float32)
    [5, 1]
    >>> shard_sizes(13, 5)
    [3, 3, 3, 2, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "shard_sizes",
    "shard_offsets",
]


def _check_shape(shape: Sequence[int], who: str) -> torch.Size:
    try:
        shape = torch.Size(shape)
    except TypeError:
        raise ValueError(f"{who}: shape must be a sequence of ints, got {shape!r}") from None
    if len(shape) < 1:
        raise ValueError(f"{who}: cannot partition a scalar (shape {tuple(shape)}) along axis 0")
    return shape


def _element_size(dtype: torch.dtype, bytes_per_string: int) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _positive_ints(who: str, optional: tuple[str, ...] = (), **values: object) -> None:
    """Raises unless each of ``values`` is a positive int (or None, for the names in ``optional``)."""
    for name, value in values.items():
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{who}: {name} must be a positive int, got {value!r}")


class Partitioner:
    """Base class: ``partitioner(shape, dtype) -> [num_shards_axis0, 1, ...]``.

    A subclass overrides ``__call__``, or ``_axis0_shards`` (the shard count for a checked shape of rank
    >= 1) as the partitioners here do.
    """

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[int]:
        size = _check_shape(shape, type(self).__name__)
        return [self._axis0_shards(size, dtype)] + [1] * (len(size) - 1)

    def _axis0_shards(self, shape: torch.Size, dtype: torch.dtype) -> int:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Splits every parameter into ``num_shards`` row shards (fewer if it has fewer rows).

    Args:
        num_shards: the number of shards, a positive int.

    Example:
        >>> FixedShardsPartitioner(2)(torch.Size([10, 3]), torch.float32)
        [2, 1]
        >>> FixedShardsPartitioner(4)(torch.Size([3]), torch.float32)
        [3]
    """

    def __init__(self, num_shards: int):
        _positive_ints("FixedShardsPartitioner", num_shards=num_shards)
        self._num_shards = num_shards

    def _axis0_shards(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return max(1, min(self._num_shards, shape[0]))

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Args:
        min_shard_bytes: the minimum size of a shard in bytes (default 256 KiB).
        max_shards: the upper bound on the number of shards (default 1).
        bytes_per_string: size assumed per element of a string tensor (kept for TF parity; torch has none).

    Example:
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)(torch.Size([6, 1]), torch.float32)
        [2, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        _positive_ints(
            "MinSizePartitioner",
            min_shard_bytes=min_shard_bytes,
            max_shards=max_shards,
            bytes_per_string=bytes_per_string,
        )
        self._min_shard_bytes, self._max_shards = min_shard_bytes, max_shards
        self._bytes_per_string = bytes_per_string

    def _axis0_shards(self, shape: torch.Size, dtype: torch.dtype) -> int:
        total = shape.numel() * _element_size(dtype, self._bytes_per_string)
        wanted = int(math.ceil(total / self._min_shard_bytes))
        return max(1, min(shape[0], self._max_shards, wanted))

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards})"


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (a row is never split), at most ``max_shards``.

    Args:
        max_shard_bytes: the maximum size of a shard in bytes.
        max_shards: an optional upper bound on the number of shards; it wins over ``max_shard_bytes``.
        bytes_per_string: size assumed per element of a string tensor (kept for TF parity).

    Example:
        >>> MaxSizePartitioner(max_shard_bytes=8)(torch.Size([6, 1]), torch.float32)
        [3, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _positive_ints(
            "MaxSizePartitioner",
            ("max_shards",),
            max_shard_bytes=max_shard_bytes,
            max_shards=max_shards,
            bytes_per_string=bytes_per_string,
        )
        self._max_shard_bytes, self._max_shards = max_shard_bytes, max_shards
        self._bytes_per_string = bytes_per_string

    def _axis0_shards(self, shape: torch.Size, dtype: torch.dtype) -> int:
        if shape[0] == 0:
            return 1
        bytes_per_row = shape.numel() / shape[0] * _element_size(dtype, self._bytes_per_string)
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_row)) if bytes_per_row else shape[0]
        shards = int(math.ceil(shape[0] / rows_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        return max(1, shards)

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards})"


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """Rows per shard: contiguous, the first ``rows % num_shards`` shards one row larger."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    base, extra = divmod(rows, num_shards)
    return [base + 1 if i < extra else base for i in range(num_shards)]


def shard_offsets(rows: int, num_shards: int) -> list[int]:
    """The first row of each shard (``len == num_shards + 1``; the last entry is ``rows``)."""
    offsets = [0]
    for s in shard_sizes(rows, num_shards):
        offsets.append(offsets[-1] + s)
    return offsets


def num_shards_from(partitioner, shape: torch.Size, dtype: torch.dtype) -> int:
    """Calls a partitioner and checks it only splits axis 0; returns the shard count (1 = unsharded)."""
    if len(shape) == 0 or shape[0] <= 1:
        return 1
    result = partitioner(shape, dtype)
    if isinstance(result, int):
        result = [result] + [1] * (len(shape) - 1)
    result = list(result)
    if len(result) != len(shape) or any(int(p) != 1 for p in result[1:]) or int(result[0]) < 1:
        raise ValueError(
            f"variable_partitioner {partitioner!r} returned {result} for shape {tuple(shape)}: only axis 0 can "
            "be partitioned (expected [k, 1, ...] with k >= 1)"
        )
    return min(int(result[0]), shape[0])
