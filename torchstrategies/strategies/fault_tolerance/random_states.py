"""The random states a fault-tolerant step may draw from: torch's (CPU, and the worker's CUDA device), Python's
``random`` and numpy's global generator.

Two uses: a discarded step gives back its draws (:class:`RandomStates` taken before ``step_fn``, restored on
abort), and a returning worker receives the live member's states (:func:`capture` / :func:`restore`, a
structure of tensors, ints, floats and None that ``state_transfer.encode`` types: nothing is unpickled).
numpy is optional: without it, its entry is None.
"""

from __future__ import annotations

import random
from typing import Any

import torch

_np: Any
try:
    import numpy as _np
except ImportError:  # numpy is not a dependency: its generator is then not part of the state
    _np = None

__all__ = ["RandomStates", "capture", "restore"]


class RandomStates:
    """The random states as they are now, to put back with :meth:`restore` (a discarded step's draws).

    Args:
        device: the worker's device (its CUDA generator is included when it is a CUDA device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.python = random.getstate()
        self.numpy = _np.random.get_state() if _np is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        if _np is not None:
            _np.random.set_state(self.numpy)


def capture(device: torch.device) -> dict[str, Any]:
    """The random states as a typed structure (tensors and numbers) for ``state_transfer``."""
    version, mt, gauss = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": None,
    }
    if _np is not None:
        kind, keys, pos, has_gauss, cached = _np.random.get_state()
        out["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(_np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    return out


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Sets the random states :func:`capture` captured (on another worker).

    Raises:
        ValueError: a malformed entry (a wrong type or size), named.
    """
    torch.set_rng_state(_tensor(state["torch"], torch.uint8, "torch").cpu())
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(_tensor(state["cuda"], torch.uint8, "cuda").cpu(), device)
    py = state["python"]
    mt = _tensor(py["mt"], torch.int64, "python.mt")
    gauss = py["gauss"]
    if not isinstance(py["version"], int) or not (gauss is None or isinstance(gauss, float)):
        raise ValueError(f"random state python: malformed version {py['version']!r} or gauss {gauss!r}")
    random.setstate((py["version"], tuple(int(v) for v in mt.tolist()), gauss))
    np_state = state.get("numpy")
    if _np is not None and np_state is not None:
        keys = _tensor(np_state["keys"], torch.int64, "numpy.keys")
        _np.random.set_state((str(np_state["kind"]), keys.numpy().astype(_np.uint32), int(np_state["pos"]),
                              int(np_state["has_gauss"]), float(np_state["cached"])))


def _tensor(x: object, dtype: torch.dtype, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != 1:
        raise ValueError(f"random state {name}: expected a 1-d {dtype} tensor, got {x!r:.80}")
    return x
