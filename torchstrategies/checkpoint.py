"""Checkpoints for distributed training: ``Checkpoint``, ``CheckpointManager``, ``PreemptionCheckpointHandler``.

TF's ``tf.train.Checkpoint`` / ``tf.train.CheckpointManager`` /
``tf.distribute.experimental.PreemptionCheckpointHandler`` for torch objects:

* What is saved: modules (``state_dict``), optimizers, distributed datasets (their ``(epoch, batches
  consumed)`` position), ``ts.Variable`` objects, and ints (e.g. ``step``), all given as keyword arguments.
* Under MultiWorkerMirroredStrategy, ``save`` is a collective (every worker calls it; it talks through the
  strategy's process group, like everything else of the strategy): module buffers (ON_READ,
  MEAN) are saved as their cross-worker mean and ON_READ variables as their aggregate (SUM, MEAN or the
  first replica's value); the chief (rank 0) alone writes, to a temporary file renamed into place (a
  reader never sees a partial file), then all workers pass a barrier. Every worker reads on ``restore``;
  by TF's rule a SUM ON_READ variable gets ``value / num_replicas`` on each worker, anything else the value.
* ``PreemptionCheckpointHandler``: a worker that receives SIGTERM finishes its current step; after the step
  all workers agree (one tiny all-reduce), save, and exit with :data:`RESTARTABLE_EXIT_CODE` (42), so
  ``torchrun --max-restarts=N`` restarts them and the handler resumes from the checkpoint; the resumed run
  equals an uninterrupted one.

Example:
    >>> import torch, torchstrategies as ts
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> ckpt = ts.checkpoint.Checkpoint(model=model, optimizer=opt, step=0)
    >>> import tempfile, os
    >>> path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt-0.pt"))
    >>> ckpt.restore(path).step
    0
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended, live_extendeds

__all__ = ["Checkpoint", "CheckpointManager", "PreemptionCheckpointHandler", "RESTARTABLE_EXIT_CODE"]

log = logging.getLogger("torchstrategies.checkpoint")

RESTARTABLE_EXIT_CODE = 42
_FORMAT = "torchstrategies-checkpoint-1"


P = ParamSpec("P")
R = TypeVar("R")


class _Variable(Protocol):
    """What a checkpoint reads and writes of a ``ts.Variable``."""

    @property
    def synchronization(self) -> object: ...

    @property
    def aggregation(self) -> object: ...

    def read_value(self) -> object: ...

    def assign(self, value: torch.Tensor) -> object: ...


def _mwms_extended() -> MultiWorkerMirroredExtended | None:
    """The live MultiWorkerMirroredStrategy's extended, if any (saving is then a collective)."""
    for ext in list(live_extendeds()):
        return ext
    return None


def _is_variable(obj: object) -> bool:
    return hasattr(obj, "read_value") and hasattr(obj, "assign") and hasattr(obj, "synchronization")


class Checkpoint:
    """Groups the objects to save; ints are kept as attributes (``ckpt.step``).

    Args:
        **objects: ``torch.nn.Module``, ``torch.optim.Optimizer``, distributed datasets (with ``position`` /
            ``restore_position``), ``ts.Variable`` or ``int`` values.

    Raises:
        TypeError: an object of another kind.

    Example:
        >>> ckpt = Checkpoint(model=torch.nn.Linear(1, 1), step=3)
        >>> ckpt.step
        3
    """

    def __init__(self, **objects: object):
        self._objects: dict[str, Any] = {}
        self._ints: dict[str, int] = {}
        for name, obj in objects.items():
            if isinstance(obj, bool) or not isinstance(obj, int):
                if not (isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or _is_variable(obj)
                        or hasattr(obj, "restore_position")):
                    raise TypeError(
                        f"Checkpoint: {name}={type(obj).__name__} is not a module, optimizer, distributed dataset, "
                        "ts.Variable or int")
                self._objects[name] = obj
            else:
                self._ints[name] = int(obj)

    def __getattr__(self, name: str) -> Any:
        ints = self.__dict__.get("_ints", {})
        if name in ints:
            return ints[name]
        objs = self.__dict__.get("_objects", {})
        if name in objs:
            return objs[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self._ints:
            self._ints[name] = int(value)
        else:
            raise AttributeError(f"Checkpoint has no int attribute {name!r}; pass it to the constructor")

    # --- state -------------------------------------------------------------------------------------------
    def _state(self, ext: MultiWorkerMirroredExtended | None) -> dict[str, Any]:
        state: dict[str, Any] = {"format": _FORMAT, "ints": dict(self._ints), "objects": {}}
        for name, obj in self._objects.items():
            if isinstance(obj, torch.nn.Module):
                sd = obj.state_dict()
                if ext is not None:
                    sd = _mean_buffers(ext, obj, sd)
                state["objects"][name] = {"kind": "module", "state": sd}
            elif isinstance(obj, torch.optim.Optimizer):
                state["objects"][name] = {"kind": "optimizer", "state": obj.state_dict()}
            elif _is_variable(obj):
                state["objects"][name] = {"kind": "variable", "state": _read_variable(ext, obj)}
            else:
                state["objects"][name] = {"kind": "dataset", "state": list(obj.position)}
        return state

    def save(self, path: str) -> str:
        """Writes a checkpoint to ``path`` (chief only, atomically); a collective under MultiWorkerMirrored."""
        ext = _mwms_extended()
        if ext is not None:
            ext.check_divergence(f"the checkpoint save to {path!r}")  # what the chief writes is every rank's
        state = self._state(ext)
        chief = ext is None or ext.should_checkpoint
        if chief:
            _atomic_save(state, path)
        if ext is not None:
            ext.barrier()
        return path

    write = save

    def restore(self, path: str) -> Checkpoint:
        """Loads ``path`` into the objects (every worker reads); returns self."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint.restore: no checkpoint at {path!r}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"Checkpoint.restore: {path!r} is not a torchstrategies checkpoint")
        ext = _mwms_extended()
        missing = [n for n in self._objects if n not in state["objects"]]
        if missing:
            raise ValueError(f"Checkpoint.restore: {path!r} has no entry for {missing}")
        for name, obj in self._objects.items():
            entry = state["objects"][name]
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(entry["state"])
            elif isinstance(obj, torch.optim.Optimizer):
                obj.load_state_dict(entry["state"])
            elif _is_variable(obj):
                _restore_variable(ext, obj, entry["state"])
            else:
                obj.restore_position(*entry["state"])
        for k, v in state["ints"].items():
            if k in self._ints:
                self._ints[k] = int(v)
        return self

    read = restore


def _atomic_save(state: dict[str, Any], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _mean_buffers(ext: MultiWorkerMirroredExtended, module: torch.nn.Module, sd: dict[str, Any]) -> dict[str, Any]:
    """Buffers are ON_READ / MEAN: the saved value is the cross-worker mean (integer buffers: rank 0's)."""
    names = [n for n, _ in module.named_buffers() if n in sd and torch.is_floating_point(sd[n])]
    if not names:
        return sd
    means = ext.all_reduce_tensors("mean", [sd[n] for n in names])
    out = dict(sd)
    for n, m in zip(names, means):
        out[n] = m.to(sd[n].device)
    return out


def _read_variable(ext: MultiWorkerMirroredExtended | None, v: _Variable) -> torch.Tensor:
    value = torch.as_tensor(v.read_value()).detach().clone()
    sync = getattr(v.synchronization, "name", str(v.synchronization))
    if ext is None or sync != "ON_READ":
        return value
    agg = getattr(v.aggregation, "name", str(v.aggregation))
    if agg in ("SUM", "MEAN"):
        return ext.all_reduce_tensors(agg, [value])[0]
    box = [value]
    ext.broadcast_tensors(box, src=0)  # ONLY_FIRST_REPLICA / NONE: replica 0's value
    return box[0]


def _restore_variable(ext: MultiWorkerMirroredExtended | None, v: _Variable, value: torch.Tensor) -> None:
    sync = getattr(v.synchronization, "name", str(v.synchronization))
    agg = getattr(v.aggregation, "name", str(v.aggregation))
    if ext is not None and sync == "ON_READ" and agg == "SUM":
        value = value / ext.world_size  # TF: each replica holds value / num_replicas so the sum reads back
    v.assign(value)


class CheckpointManager:
    """Numbered checkpoints in a directory, keeping the newest ``max_to_keep`` (``tf.train.CheckpointManager``).

    Example:
        >>> import tempfile
        >>> m = CheckpointManager(Checkpoint(step=1), tempfile.mkdtemp(), max_to_keep=2)
        >>> os.path.basename(m.save())
        'ckpt-1.pt'
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt", step_counter: str | None = "step"):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        self.checkpoint = checkpoint
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name
        self.step_counter = step_counter
        self._save_counter = 0

    @property
    def checkpoints(self) -> list[str]:
        """Existing checkpoints, oldest first."""
        pat = re.compile(re.escape(self.checkpoint_name) + r"-(\d+)\.pt$")
        found = []
        for p in glob.glob(os.path.join(self.directory, f"{self.checkpoint_name}-*.pt")):
            m = pat.search(os.path.basename(p))
            if m:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    @property
    def latest_checkpoint(self) -> str | None:
        ckpts = self.checkpoints
        return ckpts[-1] if ckpts else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Saves ``<name>-<number>.pt`` (number: the ``step`` int of the checkpoint, else a counter)."""
        if checkpoint_number is None:
            if self.step_counter and self.step_counter in self.checkpoint._ints:
                checkpoint_number = self.checkpoint._ints[self.step_counter]
            else:
                self._save_counter += 1
                checkpoint_number = self._save_counter
        path = os.path.join(self.directory, f"{self.checkpoint_name}-{int(checkpoint_number)}.pt")
        self.checkpoint.save(path)
        ext = _mwms_extended()
        if (ext is None or ext.should_checkpoint) and self.max_to_keep is not None:
            for old in self.checkpoints[:-self.max_to_keep]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
            _atomic_write_text(os.path.join(self.directory, "checkpoint"),
                               json.dumps({"latest": os.path.basename(path)}))
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one; returns its path (else None)."""
        latest = self.latest_checkpoint
        if latest is not None:
            self.checkpoint.restore(latest)
        return latest


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class PreemptionCheckpointHandler:
    """Saves and exits cleanly when a worker is told to stop (SIGTERM); resumes after a restart.

    Construction restores the latest checkpoint (as TF's handler does). ``run(fn, *args)`` calls ``fn``
    (one training step), counts it in ``total_run_calls`` (kept in the checkpoint's ``step``), then, if any
    worker has received SIGTERM since, every worker saves and exits with ``exit_code``.

    Args:
        checkpoint_manager: a :class:`CheckpointManager` whose checkpoint has a ``step`` int.
        exit_code: the status a restartable exit uses (torchrun restarts on any non-zero status).
        signals: the signals that request a save-and-exit.

    Example:
        >>> # torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py     # doctest: +SKIP
        >>> handler = PreemptionCheckpointHandler(manager)                          # doctest: +SKIP
        >>> while handler.total_run_calls < total_steps:                           # doctest: +SKIP
        ...     handler.run(train_step, next(batches))
    """

    def __init__(self, checkpoint_manager: CheckpointManager, exit_code: int = RESTARTABLE_EXIT_CODE,
                 signals: tuple[int, ...] = (signal.SIGTERM,), exit_fn: Callable[[int], object] | None = None):
        if "step" not in checkpoint_manager.checkpoint._ints:
            raise ValueError(
                "PreemptionCheckpointHandler needs a Checkpoint with a `step` int, e.g. Checkpoint(..., step=0)")
        self.manager = checkpoint_manager
        self.exit_code = exit_code
        self._exit_fn = exit_fn or sys.exit
        self._requested = False
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        self.restored_from = checkpoint_manager.restore_or_initialize()
        if self.restored_from:
            log.info("resumed from %s at step %d", self.restored_from, self.total_run_calls)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.warning("received signal %d: will save a checkpoint after the current step and exit", signum)
        self._requested = True

    @property
    def total_run_calls(self) -> int:
        return self.manager.checkpoint._ints["step"]

    def _agreed(self) -> bool:
        ext = _mwms_extended()
        if ext is None:
            return self._requested
        flag = torch.tensor([1 if self._requested else 0], dtype=torch.int64)
        return bool(ext.all_reduce_tensors("max", [flag])[0].item())

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Runs one step; saves and exits with ``exit_code`` afterwards if a stop was requested."""
        out = fn(*args, **kwargs)
        self.manager.checkpoint._ints["step"] += 1
        if self._agreed():
            path = self.manager.save()
            log.warning("saved %s at step %d; exiting with %d for a restart", path, self.total_run_calls,
                        self.exit_code)
            ext = _mwms_extended()
            if ext is not None:
                ext.shutdown()
            self._exit_fn(self.exit_code)
        return out

    def close(self) -> None:
        """Restores the previous signal handlers."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
