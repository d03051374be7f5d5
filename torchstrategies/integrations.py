"""The one-line routes onto the ``"torchstrategies"`` backend for Hugging Face Accelerate and Trainer.

Accelerate 1.x picks the CPU backend itself (gloo, or mpi) and refuses any other name, so
``InitProcessGroupKwargs(backend="torchstrategies")`` and ``TrainingArguments(ddp_backend=...)`` cannot
name ours on CPU. Both adopt a default process group that already exists, though, and then run every
collective (DDP's gradient all-reduce included) on it. So the supported route makes the group first and
then builds the library's object; it also corrects what the library reports as its backend, which it
computed before seeing the group:

* Accelerate: ``accelerator = torchstrategies.integrations.accelerator(cpu=True)`` instead of
  ``Accelerator(cpu=True)`` (any Accelerator keyword argument).
* Trainer: ``args = torchstrategies.integrations.training_arguments(output_dir="out", use_cpu=True, ...)``
  instead of ``TrainingArguments(...)`` (any TrainingArguments keyword argument; ``ddp_backend`` left unset).

Neither library is patched, and nothing here is imported by the rest of torchstrategies. Lightning needs
none of this: ``DDPStrategy(process_group_backend="torchstrategies")`` (docs/torch_distributed.md).
Launch with torchrun (or ``accelerate launch``), which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
Under plain ``python`` (no launcher: neither RANK nor WORLD_SIZE set) both run as one process, as
``Accelerator()`` and ``TrainingArguments`` do, and no process group is made.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from torchstrategies.collectives.backend import BACKEND
from torchstrategies.strategies._mw_cluster import import_dynamo_first

__all__ = ["init_process_group", "launched", "accelerator", "training_arguments"]


def init_process_group(timeout_seconds: float | None = None) -> None:
    """Initializes the default process group on the ``"torchstrategies"`` backend from the launcher's
    environment (``env://``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), unless one exists on it already.

    Raises:
        ValueError: a default process group exists on another backend (named), or the environment lacks a
            launcher's variables.
    """
    if dist.is_initialized():
        backend = str(dist.get_backend())
        if BACKEND not in backend:
            raise ValueError(f"the default process group already runs on {backend!r}; call "
                             f"torchstrategies.integrations before anything initializes torch.distributed")
        return
    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=float(timeout_seconds))
    import_dynamo_first()   # before the group: else its gloo threads may abort the exit (_mw_cluster.py)
    try:
        dist.init_process_group(BACKEND, timeout=timeout)
    except ValueError as exc:
        raise ValueError(f"cannot initialize the {BACKEND!r} process group from the environment ({exc}); launch "
                         "with torchrun or `accelerate launch`") from None


def launched() -> bool:
    """True when a launcher started this process (torchrun, ``accelerate launch``, a cluster's: RANK or
    WORLD_SIZE is set); False under plain ``python``, where the routes below run one process."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def _report_our_backend() -> None:
    """Accelerate's shared state names the backend it chose before it saw our group: name the group's."""
    from accelerate.state import PartialState

    state = PartialState()
    if getattr(state, "backend", None) not in (None, str(dist.get_backend())):
        state.backend = str(dist.get_backend())


def accelerator(**kwargs: Any) -> Any:
    """``accelerate.Accelerator(**kwargs)`` whose collectives run on the ``"torchstrategies"`` backend.

    Example:
        >>> from torchstrategies.integrations import accelerator   # doctest: +SKIP
        >>> acc = accelerator(cpu=True)                             # doctest: +SKIP
        >>> acc.state.backend                                       # doctest: +SKIP
        'torchstrategies'
    """
    from accelerate import Accelerator

    if not launched():
        return Accelerator(**kwargs)  # one process, as Accelerator() runs under plain python
    init_process_group()
    acc = Accelerator(**kwargs)
    _report_our_backend()
    acc.state.backend = str(dist.get_backend())  # (AcceleratorState copied the shared state when made)
    return acc


def training_arguments(**kwargs: Any) -> Any:
    """``transformers.TrainingArguments(**kwargs)`` for a Trainer whose DDP runs on our backend.

    Raises:
        ValueError: ``ddp_backend`` names another backend (it would replace ours).
    """
    from transformers import TrainingArguments

    asked = kwargs.pop("ddp_backend", None)
    if asked not in (None, BACKEND):
        raise ValueError(f"training_arguments runs DDP on {BACKEND!r}; got ddp_backend={asked!r} "
                         "(use transformers.TrainingArguments directly for another backend)")
    if not launched():
        return TrainingArguments(**kwargs)  # one process, as TrainingArguments runs under plain python
    init_process_group(kwargs.get("ddp_timeout"))
    args = TrainingArguments(**kwargs)
    _ = args.device  # TrainingArguments sets up Accelerate's state here
    _report_our_backend()
    return args
