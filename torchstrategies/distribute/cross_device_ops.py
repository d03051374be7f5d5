"""Cross-device (in-process) reductions: ReductionToOneDevice, NcclAllReduce, HierarchicalCopyAllReduce.

These combine the components of a PerReplica value (one per local replica, possibly on different devices)
and place the result on the destination devices, as TF's ``cross_device_ops.py``. Gradients are summed
with the kernel an ``AggregationMethod`` picks (``ts.aggregate``), or with any callable.

Example:
    >>> import torch, torchstrategies as ts
    >>> ops = ts.ReductionToOneDevice(accumulation_fn=ts.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N)
    >>> ops.reduce("sum", ts.PerReplica((torch.ones(2), torch.ones(2))), destinations="cpu")
    tensor([2., 2.])
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from torchstrategies.aggregation import AggregationMethod, _resolve, aggregate
from torchstrategies.distribute import device_util, values
from torchstrategies.distribute.device_util import DeviceLike
from torchstrategies.distribute.values import Destinations, DistributedValues, Mirrored, PerReplica, Reducible
from torchstrategies.ops import FLOAT_DTYPES, accumulate_grouped_, tree_reduce
from torchstrategies.reduce_op import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from torchstrategies.collectives.options import CommunicationOptions

__all__ = [
    "DEFAULT_ACCUMULATION",
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "select_cross_device_ops",
]

_log = logging.getLogger("torchstrategies.distribute")

# Measured (python -m torchstrategies.distribute.measure, docs/strategies.md): the fused one-pass kernel
# sums 2-4 large gradients (4e6 floats) in 0.6-0.8x the time of sequential torch adds, and far faster
# when torch's threaded add competes for busy cores; torch's add wins on mid-sized tensors with one thread.
# Large tensors dominate a step, so it is the default when no accumulation_fn is given.
DEFAULT_ACCUMULATION = AggregationMethod.EXPERIMENTAL_ACCUMULATE_N

# What ``batch_reduce_implementation`` gets: each value with the devices its result goes to.
Pairs: TypeAlias = "list[tuple[DistributedValues[object], tuple[torch.device, ...]]]"


def _as_per_replica(value: Reducible) -> DistributedValues[object]:
    if isinstance(value, DistributedValues):
        return value
    if isinstance(value, (int, float, bool)) or isinstance(value, torch.Tensor):
        return PerReplica((torch.as_tensor(value),))
    raise TypeError(f"Expected argument of type DistributedValues or torch.Tensor, but got {value!r}")


def destination_devices(destinations: Destinations) -> tuple[torch.device, ...]:
    """Devices named by ``destinations``: a device, a tensor, a DistributedValues, or a list of devices.

    Device names may be torch's (``"cuda:1"``) or TF's (``"/gpu:1"``,
    ``"/job:localhost/replica:0/task:0/device:CPU:0"``); see ``distribute/device_util.py``.

    Raises:
        ValueError: empty, of an unknown type, or not a device name.
    """
    if isinstance(destinations, DistributedValues):
        return tuple(torch.as_tensor(c).device for c in destinations.values)
    if isinstance(destinations, torch.Tensor):
        return (destinations.device,)
    if isinstance(destinations, (str, torch.device)):
        if isinstance(destinations, str) and not destinations:
            raise ValueError("destinations can not be empty")
        return (device_util.resolve(destinations),)
    if isinstance(destinations, (tuple, list)):
        if not destinations:
            raise ValueError("destinations can not be empty")
        return tuple(
            d.device if isinstance(d, torch.Tensor) else device_util.resolve(d) for d in destinations
        )
    raise ValueError(
        "destinations must be one of a `DistributedValues` object, a tensor, or a device string, "
        f"got {destinations!r}"
    )


def _place(t: torch.Tensor, devices: tuple[torch.device, ...]) -> torch.Tensor | Mirrored[torch.Tensor]:
    """``t`` on one device, or a Mirrored of distinct copies (no two replicas share a tensor object)."""
    if len(devices) == 1:
        return t if t.device == devices[0] else t.to(devices[0])
    comps = []
    for i, d in enumerate(devices):
        c = t.to(d) if t.device != d else t
        comps.append(c if i == 0 or c is not t else t.clone())
    return Mirrored(tuple(comps))


class CrossDeviceOps:
    """Base class: how the components of a PerReplica value are reduced and broadcast."""

    def reduce(
        self,
        reduce_op: ReduceOp | str,
        per_replica_value: Reducible,
        destinations: Destinations,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduces ``per_replica_value`` to ``destinations``: a tensor for one device, else a Mirrored."""
        op = ReduceOp.from_any(reduce_op)
        value = _as_per_replica(per_replica_value)
        devices = destination_devices(destinations)
        return self.batch_reduce_implementation(op, [(value, devices)], options)[0]

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Reducible, Destinations]],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """``reduce`` for a list of (value, destinations) pairs."""
        op = ReduceOp.from_any(reduce_op)
        pairs = [
            (_as_per_replica(v), destination_devices(d))
            for v, d in values.checked_pairs("CrossDeviceOps.batch_reduce", value_destination_pairs)
        ]
        return self.batch_reduce_implementation(op, pairs, options)

    def broadcast(self, tensor: torch.Tensor, destinations: Destinations) -> torch.Tensor | Mirrored[torch.Tensor]:
        """Copies ``tensor`` to every destination device."""
        return _place(torch.as_tensor(tensor), destination_devices(destinations))

    def batch_reduce_implementation(
        self, op: ReduceOp, pairs: Pairs, options: CommunicationOptions | None
    ) -> list[Any]:
        raise NotImplementedError

    def sum_gradients(self, groups: Sequence[tuple[torch.device, list[torch.Tensor]]]) -> list[torch.Tensor]:
        """The in-process fold's gradient sums (``distribute/replicated.py``): for each (device, the
        replicas' gradients of one parameter), their sum on that device, which may be the group's first
        tensor summed into in place (replica 0's own gradient, as DDP reduces into ``.grad``). Here: through
        ``batch_reduce_implementation``, into new tensors."""
        pairs: Pairs = [(PerReplica(tuple(grads)), (device,)) for device, grads in groups]
        return self.batch_reduce_implementation(ReduceOp.SUM, pairs, None)


class ReductionToOneDevice(CrossDeviceOps):
    """Copies all components to one device, sums them there, and copies the result back.

    Args:
        reduce_to_device: where the sum is computed; None means the first destination device.
        accumulation_fn: an ``AggregationMethod`` (or its name) choosing our summing kernel, or a callable
            ``fn(list_of_tensors) -> tensor``; None means ``DEFAULT_ACCUMULATION`` (EXPERIMENTAL_ACCUMULATE_N,
            chosen by measurement: see ``python -m torchstrategies.distribute.measure`` and
            docs/strategies.md).

    Example:
        >>> import torch, torchstrategies as ts
        >>> ts.ReductionToOneDevice(accumulation_fn=lambda ts_: sum(ts_)).reduce(
        ...     "mean", ts.PerReplica((torch.tensor(1.0), torch.tensor(3.0))), "cpu")
        tensor(2.)
    """

    def __init__(
        self,
        reduce_to_device: DeviceLike | None = None,
        accumulation_fn: AggregationMethod
        | str
        | int
        | Callable[[list[torch.Tensor]], torch.Tensor]
        | None = None,
    ):
        self.reduce_to_device = (
            device_util.resolve(reduce_to_device) if reduce_to_device is not None else None
        )
        if accumulation_fn is None:
            accumulation_fn = DEFAULT_ACCUMULATION
        if isinstance(accumulation_fn, (AggregationMethod, str, int)):
            self._method: AggregationMethod | None = _resolve(accumulation_fn)
            self._fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
        elif callable(accumulation_fn):
            self._method, self._fn = None, accumulation_fn
        else:
            raise TypeError(
                "accumulation_fn must be an AggregationMethod, its name, or a callable, got "
                f"{accumulation_fn!r}"
            )

    @property
    def accumulation_fn(self) -> AggregationMethod | Callable[[list[torch.Tensor]], torch.Tensor] | None:
        return self._fn if self._fn is not None else self._method

    def __repr__(self) -> str:
        return (
            f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device}, "
            f"accumulation_fn={self.accumulation_fn!r})"
        )

    def _sum(self, tensors: list[torch.Tensor], scale: float | None) -> torch.Tensor:
        if self._fn is not None:
            out = self._fn(list(tensors))
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"accumulation_fn returned {type(out).__name__}, expected a torch.Tensor")
            return out * scale if scale is not None else out
        if len(tensors) == 1:
            t = tensors[0].clone()
            return t * scale if scale is not None else t
        if any(t.layout != torch.strided for t in tensors):
            # Sparse gradients (nn.Embedding(sparse=True)): torch's sparse add, coalesced (TF sums
            # IndexedSlices by concatenating them; coalescing adds the rows of repeated indices).
            out = tensors[0]
            for t in tensors[1:]:
                out = out + t
            out = out.coalesce() if out.is_sparse else out
            return out * scale if scale is not None else out
        if tensors[0].dtype in FLOAT_DTYPES:
            return aggregate(tensors, self._method, scale=scale)
        out = aggregate(tensors, AggregationMethod.ADD_N)
        return out / (1.0 / scale) if scale is not None else out

    def sum_gradients(self, groups: Sequence[tuple[torch.device, list[torch.Tensor]]]) -> list[torch.Tensor]:
        """As the base class, with the groups our kernels take (dense floating-point gradients on their
        parameter's device, the sum's device, outside any graph) summed into their first tensor, all in
        one grouped call per kernel: ``accumulate_grouped_`` (EXPERIMENTAL_ACCUMULATE_N), ``tree_reduce``
        with ``out`` (EXPERIMENTAL_TREE) or ``torch._foreach_add_`` per replica (ADD_N)."""
        if self._fn is not None:
            return super().sum_gradients(groups)
        totals: list[torch.Tensor | None] = [None] * len(groups)
        inplace: dict[int, list[int]] = {}  # group size -> the groups of that size summed in place
        rest: list[int] = []
        for i, (device, grads) in enumerate(groups):
            g0 = grads[0]
            ok = (device == g0.device and (self.reduce_to_device is None or self.reduce_to_device == device)
                  and g0.dtype in FLOAT_DTYPES and all(g.layout == torch.strided and not g.requires_grad
                                                       for g in grads))
            if ok:
                inplace.setdefault(len(grads), []).append(i)
            else:
                rest.append(i)
        with torch.no_grad():
            for members in inplace.values():
                firsts = [groups[i][1][0] for i in members]
                others = [groups[i][1][1:] for i in members]
                if self._method == AggregationMethod.EXPERIMENTAL_ACCUMULATE_N:
                    accumulate_grouped_(firsts, others)
                elif self._method == AggregationMethod.EXPERIMENTAL_TREE:
                    for first, grads in zip(firsts, (groups[i][1] for i in members)):
                        tree_reduce(grads, out=first)
                else:
                    for k in range(len(others[0])):
                        torch._foreach_add_(firsts, [o[k] for o in others])
                for i, first in zip(members, firsts):
                    totals[i] = first
        if rest:
            for i, total in zip(rest, super().sum_gradients([groups[i] for i in rest])):
                totals[i] = total
        return totals  # type: ignore[return-value]

    def batch_reduce_implementation(
        self, op: ReduceOp, pairs: Pairs, options: CommunicationOptions | None
    ) -> list[Any]:
        results = []
        for value, devices in pairs:
            comps = [torch.as_tensor(c) for c in value.values]
            target = self.reduce_to_device or devices[0]
            comps = [c if c.device == target else c.to(target) for c in comps]
            shape0 = comps[0].shape
            for i, c in enumerate(comps[1:], start=1):
                if c.shape != shape0:
                    raise ValueError(
                        f"Cannot reduce components of different shapes: replica {i} has "
                        f"{tuple(c.shape)}, replica 0 has {tuple(shape0)}"
                    )
            if op == ReduceOp.SUM:
                out = self._sum(comps, None)
            elif op == ReduceOp.MEAN:
                if comps[0].is_floating_point() or comps[0].is_complex():
                    out = self._sum(comps, 1.0 / len(comps))
                else:
                    out = self._sum(comps, None) / len(comps)
            elif op == ReduceOp.MIN:
                out = torch.stack(comps).amin(0)
            else:
                out = torch.stack(comps).amax(0)
            results.append(_place(out, devices))
        return results


class _AllReduceOnCuda(CrossDeviceOps):
    _name = "NcclAllReduce"

    def __init__(self, num_packs: int = 1):
        if not isinstance(num_packs, int) or isinstance(num_packs, bool) or num_packs < 0:
            raise ValueError(f"{self._name} requires num_packs >= 0, but {num_packs!r} is specified")
        self.num_packs = num_packs
        self._fallback = ReductionToOneDevice()
        self._warned = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"

    def batch_reduce_implementation(
        self, op: ReduceOp, pairs: Pairs, options: CommunicationOptions | None
    ) -> list[Any]:
        all_cuda = all(torch.as_tensor(c).device.type == "cuda" for v, _ in pairs for c in v.values) and all(
            d.type == "cuda" for _, ds in pairs for d in ds
        )
        if not all_cuda or op in (ReduceOp.MIN, ReduceOp.MAX):
            if not self._warned:
                warnings.warn(
                    f"{self._name} needs all components and destinations on CUDA devices (and SUM/MEAN); "
                    "falling back to ReductionToOneDevice",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._warned = True
            return self._fallback.batch_reduce_implementation(op, pairs, options)
        return [self._cuda_reduce(op, v, ds) for v, ds in pairs]

    def _cuda_reduce(
        self, op: ReduceOp, value: DistributedValues[object], devices: tuple[torch.device, ...]
    ) -> torch.Tensor | Mirrored[torch.Tensor]:
        import torch.cuda.comm as comm

        comps = [torch.as_tensor(c) for c in value.values]
        target = devices[0]
        total = comm.reduce_add(comps, destination=target.index)
        if op == ReduceOp.MEAN:
            total = total / len(comps)
        if len(devices) == 1:
            return total
        outs = comm.broadcast(total, devices=[d.index for d in devices])
        return Mirrored(tuple(outs))


class NcclAllReduce(_AllReduceOnCuda):
    """All-reduce across GPUs of this process with NCCL (``torch.cuda.comm``).

    On CPU-only setups it warns once and falls back to ReductionToOneDevice, as TF falls back when the
    devices do not fit.

    Example:
        >>> import torchstrategies as ts
        >>> ts.NcclAllReduce(num_packs=1)
        NcclAllReduce(num_packs=1)
    """

    _name = "NcclAllReduce"


class HierarchicalCopyAllReduce(_AllReduceOnCuda):
    """TF's hierarchical-copy all-reduce; here the same CUDA reduce/broadcast path as NcclAllReduce.

    Example:
        >>> import torchstrategies as ts
        >>> ts.HierarchicalCopyAllReduce(num_packs=2)
        HierarchicalCopyAllReduce(num_packs=2)
    """

    _name = "HierarchicalCopyAllReduce"


def select_cross_device_ops(devices: Sequence[DeviceLike]) -> CrossDeviceOps:
    """The default: NcclAllReduce when every device is a CUDA device, else ReductionToOneDevice."""
    if devices and all(device_util.resolve(d).type == "cuda" for d in devices):
        return NcclAllReduce()
    return ReductionToOneDevice()
