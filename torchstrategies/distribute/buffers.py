"""Which module buffers the replicas average: the buffer half of TF's ``VariableAggregation``.

In TF a layer declares how the copies of a variable written in replica context combine: Keras'
BatchNormalization creates its moving statistics ``ON_READ`` with ``aggregation=MEAN``; any other variable
written in replica context without an aggregation is an error. torch's layers cannot declare anything, so
the rule here is:

* the running statistics of torch's normalization layers (``running_mean`` and ``running_var`` of every
  ``torch.nn.modules.batchnorm._NormBase``: BatchNorm*, InstanceNorm* with ``track_running_stats``,
  SyncBatchNorm and ``ts.nn.SyncBatchNorm``) are declared MEAN;
* any other buffer is declared by its user: ``ts.declare_buffer_aggregation(module, "name", "mean")``
  (a running baseline, a running normalizer), or ``"none"`` to take a norm layer's statistic back;
* every buffer not declared MEAN follows the parameters' rule: the replicas must write the same value to it
  in replica context, else ``ReplicaDivergenceError`` names it (a queue every replica enqueues its own keys
  into, an in-place renorm), at the point where the strategy makes the replicas' buffers equal.

The declaration is kept on the module by buffer name, so it survives ``.to()``, ``.double()`` (which
replace the buffer tensors) and ``copy.deepcopy``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.nn.modules.batchnorm import _NormBase

from torchstrategies.distribute.enums import VariableAggregation

__all__ = ["declare_buffer_aggregation", "is_mean_buffer", "mean_buffer_ids", "modules_of"]

_ATTR = "_torchstrategies_buffer_aggregation"
_NORM_STATISTICS = ("running_mean", "running_var")


def declare_buffer_aggregation(module: torch.nn.Module, name: str,
                               aggregation: VariableAggregation | str = VariableAggregation.MEAN) -> None:
    """Declares how the replicas' copies of ``module``'s buffer ``name`` combine.

    Args:
        module: the module that registered the buffer.
        name: the buffer's name in ``module`` (not a dotted path).
        aggregation: ``MEAN`` (the copies are averaged where the strategy makes buffers equal: at each
            optimizer step and at the end of ``run``) or ``NONE`` (the replicas must write the same value,
            else ``ReplicaDivergenceError``).

    Raises:
        ValueError: ``module`` has no buffer ``name``, the aggregation is neither MEAN nor NONE, or MEAN is
            asked of a buffer that is not floating point.

    Example:
        >>> import torch, torchstrategies as ts
        >>> model = torch.nn.Linear(2, 1)
        >>> model.register_buffer("baseline", torch.zeros(()))     # a REINFORCE running baseline
        >>> ts.declare_buffer_aggregation(model, "baseline", "mean")
    """
    agg = VariableAggregation.from_any(aggregation)
    if agg not in (VariableAggregation.MEAN, VariableAggregation.NONE):
        raise ValueError(f"a buffer's aggregation is MEAN or NONE, got {aggregation!r}")
    buffer = module._buffers.get(name) if isinstance(module, torch.nn.Module) else None
    if buffer is None:
        raise ValueError(f"{type(module).__name__} has no buffer {name!r} (its buffers: "
                         f"{sorted(getattr(module, '_buffers', {}))}); name a buffer of this very module")
    if agg is VariableAggregation.MEAN and not (buffer.is_floating_point() or buffer.is_complex()):
        raise ValueError(f"buffer {name!r} of {type(module).__name__} is {buffer.dtype}: only a floating "
                         "buffer can be averaged; the replicas must write the same value to an integer one")
    declared = dict(getattr(module, _ATTR, {}))   # a copy: a deep-copied module keeps its own
    declared[name] = agg
    setattr(module, _ATTR, declared)


def is_mean_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether the replicas' copies of ``module``'s buffer ``name`` are averaged (see the module doc)."""
    declared = vars(module).get(_ATTR, {}).get(name)   # (not getattr: a module's missing attribute raises inside)
    if declared is not None:
        return bool(declared is VariableAggregation.MEAN)
    return isinstance(module, _NormBase) and name in _NORM_STATISTICS


def mean_buffer_ids(modules: list[torch.nn.Module]) -> set[int]:
    """The ``id`` of every buffer declared MEAN in ``modules`` and their submodules."""
    return {id(b) for m in modules_of(*modules) for name, b in m._buffers.items()
            if b is not None and is_mean_buffer(m, name)}


def modules_of(*roots: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every module under ``roots``, each once, depth first in registration order: ``root.modules()`` of each
    root in turn, a module that two roots share yielded once (under the first), without the names that
    ``named_modules`` builds for every module. The per-step walks' traversal (MultiWorkerMirrored's agreement,
    the in-process replicas' tensors)."""
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
