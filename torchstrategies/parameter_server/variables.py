"""``PSVariable``: a ``ts.Variable`` created under a ParameterServerStrategy's scope lives on one ps task.

Reads fetch the current value from its ps; ``assign``, ``assign_add`` and ``assign_sub`` are executed by
the ps itself, atomically, so increments from several workers are never lost (TF's ps variables). The same
object works on the chief and, passed to or captured by a scheduled function, on a worker. Variables are
state (step counters, metrics), never partitioned; train weights as ``nn.Parameter``s of modules.

With one replica per worker, ``aggregation`` and ``synchronization`` do not change what an update does;
they are kept for TF compatibility (``ON_READ`` variables are ps variables too).
"""

from __future__ import annotations

import torch

from torchstrategies.parameter_server.specs import PsCall, VarSpec

__all__ = ["PSVariable"]


class PSVariable:
    """A variable held by a ps task (see the module docstring).

    Example:
        >>> with strategy.scope():                                    # doctest: +SKIP
        ...     steps = ts.Variable(0.0)
        >>> coordinator.schedule(lambda: steps.assign_add(1.0))      # doctest: +SKIP
    """

    def __init__(self, backend: PsCall, spec: VarSpec, aggregation: object = None, synchronization: object = None,
                 trainable: bool = False):
        self._backend = backend
        self._spec = spec
        self.aggregation = aggregation
        self.synchronization = synchronization
        self.trainable = trainable

    # ---- identity ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ---- reads and writes on the ps ------------------------------------------------------------
    def _call(self, op: str, value: object = None) -> list[torch.Tensor]:
        shard = self._spec.shards[0]
        tensors = [] if value is None else [torch.as_tensor(value, dtype=self.dtype).expand(self.shape).contiguous()]
        _, out = self._backend(shard.ps, {"op": op, "keys": [shard.key]}, tensors)
        return out

    def read_value(self) -> torch.Tensor:
        """The current value, fetched from the ps."""
        return self._call("pull")[0].reshape(self.shape)

    value = read_value

    def assign(self, value: object, read_value: bool = True) -> PSVariable | None:
        return self._update("assign", value, read_value)

    def assign_add(self, delta: object, read_value: bool = True) -> PSVariable | None:
        return self._update("assign_add", delta, read_value)

    def assign_sub(self, delta: object, read_value: bool = True) -> PSVariable | None:
        return self._update("assign_sub", delta, read_value)

    def _update(self, op: str, value: object, read_value: bool) -> PSVariable | None:
        """``op`` executed by the ps itself, atomically."""
        self._call(op, value)
        return self if read_value else None

    def numpy(self):
        return self.read_value().numpy()

    # ---- usable as a tensor --------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        def unwrap(x):
            if isinstance(x, PSVariable):
                return x.read_value()
            if isinstance(x, (list, tuple)):
                return type(x)(unwrap(y) for y in x)
            return x

        return func(*unwrap(args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    def __array__(self, dtype=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __bool__(self) -> bool:
        return bool(self.read_value())

    def __repr__(self) -> str:
        return f"PSVariable(name={self.name!r}, shape={tuple(self.shape)}, ps={self._spec.shards[0].ps})"


def _binary(name: str):
    def op(self, other):
        return getattr(self.read_value(), name)(other.read_value() if isinstance(other, PSVariable) else other)

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__matmul__", "__rmatmul__", "__pow__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__",
              "__getitem__"):
    if _name == "__neg__":
        setattr(PSVariable, _name, lambda self: -self.read_value())
    else:
        setattr(PSVariable, _name, _binary(_name))
