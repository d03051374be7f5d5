"""Distributed values: ``PerReplica`` (one value per replica) and ``Mirrored`` (the same value everywhere).

They hold one component per *local* replica (replicas of this process). Structures (tuples, lists, dicts)
are handled with ``torch.utils._pytree``; a DistributedValues is always a leaf.

Example:
    >>> import torch, torchstrategies as ts
    >>> v = ts.PerReplica((torch.tensor(1.0), torch.tensor(2.0)))
    >>> len(v.values)
    2
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic, TypeAlias, TypeVar, overload

import torch
from torch.utils import _pytree as pytree

from torchstrategies.distribute.device_util import DeviceLike

__all__ = [
    "Destinations",
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "select_replica",
    "regroup",
    "local_results",
    "checked_pairs",
    "Reducible",
]

T = TypeVar("T")
U = TypeVar("U")
T_co = TypeVar("T_co", covariant=True)


class DistributedValues(Generic[T_co]):
    """Base class: a value with one component per local replica (``tf.distribute.DistributedValues``)."""

    def __init__(self, values: Iterable[T_co]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component, got {values!r}")
        self._values = values

    @property
    def values(self) -> tuple[T_co, ...]:
        """The components, one per local replica (``experimental_local_results``)."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {inner}\n}}"


class PerReplica(DistributedValues[T_co]):
    """One (possibly different) value per replica, e.g. what ``strategy.run`` returns.

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> v = s.run(lambda: ts.get_replica_context().replica_id_in_sync_group)
        >>> s.experimental_local_results(v)
        (0, 1)
    """


class Mirrored(DistributedValues[T_co]):
    """The same value on every replica (e.g. the result of ``extended.reduce_to`` to several devices).

    Example:
        >>> import torch, torchstrategies as ts
        >>> m = ts.Mirrored((torch.ones(2), torch.ones(2)))
        >>> m.values[1]
        tensor([1., 1.])
    """


# What the communication methods (``reduce``, ``extended.reduce_to``, ``CrossDeviceOps.reduce``) take: a
# DistributedValues (one component per local replica) or a plain value (what ``torch.as_tensor`` takes), as
# in TF.
Reducible: TypeAlias = "DistributedValues[object] | torch.Tensor | float | Sequence[float]"
# Where a result goes: a device (name), the devices of a tensor or of a DistributedValues' components, or a
# list of devices or tensors (``cross_device_ops.destination_devices``).
Destinations: TypeAlias = "DistributedValues[object] | torch.Tensor | DeviceLike | Sequence[torch.Tensor | DeviceLike]"


def _is_leaf(x: object) -> bool:
    return isinstance(x, DistributedValues)


_CONTAINERS = (list, tuple, dict)
_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, complex})


def _component(x: object, replica_id: int) -> object:
    if isinstance(x, DistributedValues):
        if replica_id >= len(x.values):
            raise ValueError(
                f"{type(x).__name__} has {len(x.values)} components but replica {replica_id} was "
                "requested: was it created by a different strategy?"
            )
        return x.values[replica_id]
    return x


def _nested(x: object) -> bool:
    """Whether ``x`` is a pytree container (which may hold DistributedValues), not a leaf."""
    return isinstance(x, _CONTAINERS) or type(x) in pytree.SUPPORTED_NODES


@overload
def select_replica(replica_id: int, structure: DistributedValues[T]) -> T: ...
@overload
def select_replica(replica_id: int, structure: T) -> T: ...
def select_replica(replica_id: int, structure: object) -> object:
    """Replaces every DistributedValues in ``structure`` by its component for ``replica_id`` (containers keep
    their types)."""

    if (
        type(structure) is tuple
        and len(structure) == 2
        and type(structure[0]) is tuple
        and type(structure[1]) is dict
        and not any(_nested(a) for a in structure[0])
        and not any(_nested(a) for a in structure[1].values())
    ):  # the (args, kwargs) of a run with flat arguments: no pytree walk
        args, kwargs = structure
        return (
            tuple(_component(a, replica_id) for a in args),
            {k: _component(v, replica_id) for k, v in kwargs.items()},
        )

    return pytree.tree_map(lambda x: _component(x, replica_id), structure, is_leaf=_is_leaf)


def regroup(
    per_replica_outputs: Sequence[object], wrap_class: type[DistributedValues[object]] = PerReplica
) -> object:
    """Turns a list of per-replica structures into one structure of ``wrap_class`` leaves.

    A leaf that is the very same object on every replica (and any leaf when there is one replica) is
    returned unwrapped, as TF's ``regroup`` does.

    Raises:
        ValueError: the replicas returned structures of different shapes.
    """
    first = per_replica_outputs[0]
    if first is None or type(first) in _PLAIN_LEAVES or isinstance(first, DistributedValues):
        # The common results (None, a tensor, a number): leaves themselves, no pytree walk.
        if all(o is first for o in per_replica_outputs):
            return first
        if first is not None and all(
            type(o) in _PLAIN_LEAVES or isinstance(o, DistributedValues) for o in per_replica_outputs
        ):
            return wrap_class(tuple(per_replica_outputs))
    flats = []
    spec0 = None
    for i, out in enumerate(per_replica_outputs):
        leaves, spec = pytree.tree_flatten(out, is_leaf=_is_leaf)
        if spec0 is None:
            spec0 = spec
        elif spec != spec0:
            raise ValueError(
                f"Replica {i} returned a structure different from replica 0's: {spec} vs {spec0}"
            )
        flats.append(leaves)
    grouped = []
    for comps in zip(*flats, strict=False):
        first = comps[0]
        if all(c is first for c in comps[1:]):
            grouped.append(first)
        else:
            grouped.append(wrap_class(comps))
    if spec0 is None:
        raise ValueError("regroup needs the output of at least one replica, got none")
    return pytree.tree_unflatten(grouped, spec0)


@overload
def local_results(value: DistributedValues[T], num_local: int | None = None) -> tuple[T, ...]: ...
@overload
def local_results(value: T, num_local: None = None) -> tuple[T, ...]: ...
@overload
def local_results(value: object, num_local: int | None = None) -> tuple[object, ...]: ...
def local_results(value: object, num_local: int | None = None) -> tuple[object, ...]:
    """Components of ``value`` (a tuple); a plain value gives a 1-tuple, as in TF.

    A structure holding DistributedValues gives one structure per local replica (``num_local`` of them).
    """
    if isinstance(value, DistributedValues):
        return value.values
    if isinstance(value, (list, tuple, dict)) and num_local is not None:
        # A structure of DistributedValues: one structure per replica.
        leaves, _ = pytree.tree_flatten(value, is_leaf=_is_leaf)
        if any(isinstance(v, DistributedValues) for v in leaves):
            return tuple(select_replica(i, value) for i in range(num_local))
    return (value,)


def checked_pairs(where: str, pairs: Iterable[tuple[T, U]]) -> list[tuple[T, U]]:
    """``pairs`` as a list, after checking that each is a (value, destinations) pair.

    Raises:
        ValueError: an element is not a 2-tuple or 2-list.
    """
    out = list(pairs)
    for p in out:
        if not (isinstance(p, (tuple, list)) and len(p) == 2):
            raise ValueError(f"{where} expects a list of (value, destinations) pairs, got {p!r}")
    return out
