"""A picture of torch's process-wide state that a library can patch: the attributes of torch's module,
optimizer, scheduler and grad-scaler classes (and of every subclass loaded so far), ``torch.autograd``'s
``backward`` and ``grad``, and the global hook
registries of ``torch.nn.modules.module`` and ``torch.optim.optimizer``. ``changes(before, after)`` lists
what differs, by identity, so a test can say that torch was left as it was found."""

from __future__ import annotations

import importlib

import torch

_REGISTRY_MODULES = ("torch.nn.modules.module", "torch.optim.optimizer")
_FUNCTIONS = {"torch.autograd": ("backward", "grad")}   # module functions a library may wrap


def _classes() -> list[type]:
    roots: list[type] = [torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                         torch.amp.GradScaler]
    seen: dict[type, None] = {}
    stack = list(roots)
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen[cls] = None
            stack.extend(cls.__subclasses__())
    return list(seen)


def snapshot() -> dict[str, dict[str, object]]:
    """{"class <qualname>" or "registry <module>.<name>": {key: object}} for everything that can be patched."""
    pic: dict[str, dict[str, object]] = {}
    for cls in _classes():
        pic[f"class {cls.__module__}.{cls.__qualname__} at {id(cls):#x}"] = dict(vars(cls))
    for name, attrs in _FUNCTIONS.items():
        mod = importlib.import_module(name)
        pic[f"functions {name}"] = {a: getattr(mod, a) for a in attrs}
    for name in _REGISTRY_MODULES:
        mod = importlib.import_module(name)
        for attr, value in vars(mod).items():
            if attr.startswith("_global") and isinstance(value, dict):
                pic[f"registry {name}.{attr}"] = dict(value)
    return pic


def changes(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> list[str]:
    """What ``after`` has that ``before`` had not, or has with a different object (classes first seen in
    ``after``, e.g. a torch class first imported in between, are not compared)."""
    out = []
    for where, was in before.items():
        now = after.get(where, {})
        for key in sorted(set(was) | set(now)):
            if was.get(key, "<absent>") is not now.get(key, "<absent>"):
                out.append(f"{where}: {key} was {was.get(key, '<absent>')!r}, now {now.get(key, '<absent>')!r}")
    return out
