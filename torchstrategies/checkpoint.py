"""Checkpoints for distributed training: ``Checkpoint``, ``CheckpointManager``, ``PreemptionCheckpointHandler``.

TF's ``tf.train.Checkpoint`` / ``tf.train.CheckpointManager`` /
``tf.distribute.experimental.PreemptionCheckpointHandler`` for torch objects:

* What is saved: modules (``state_dict``), optimizers, LR schedulers, ``GradScaler`` and any object with
  ``state_dict`` / ``load_state_dict``, distributed datasets (position and seed), ``torch.Generator`` and
  :class:`RandomState` (per rank), ``ts.Variable`` objects, and ints (e.g. ``step``), all given as keyword
  arguments; and every worker's random state (unless ``save_random_state=False``). docs/fault_tolerance.md
  says what resumes exactly.
* Under MultiWorkerMirroredStrategy, ``save`` is a collective (every worker calls it; it talks through the
  strategy's process group, like everything else of the strategy): module buffers are saved under the
  buffer rule (floating: ON_READ / MEAN, as they are when equal on every worker; integer: equal or an
  error), ON_READ variables as their aggregate (SUM, MEAN or the first replica's value), per-rank state
  of every worker; the chief (rank 0) alone writes, to a temporary file renamed into place (a
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
import copy
import functools
import glob
import json
import logging
import os
import re
import signal
import sys
import uuid
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, ParamSpec, TypeVar, cast

import torch

from torchstrategies import _checkpoint_file
from torchstrategies._checkpoint_state import (
    RandomState,
    check_restorable,
    from_bytes,
    gather_per_rank,
    job_module_state,
    kind_of,
    per_rank_state,
    read_variable,
    restore_per_rank,
    restore_variable,
    to_bytes,
)
from torchstrategies.distribute import context as ts_context
from torchstrategies.distribute.distribute_lib import Strategy
from torchstrategies.errors import CheckpointError
from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended, live_extendeds

__all__ = ["Checkpoint", "CheckpointManager", "PreemptionCheckpointHandler", "RandomState", "RESTARTABLE_EXIT_CODE",
           "CheckpointError", "read_state"]

log = logging.getLogger("torchstrategies.checkpoint")

RESTARTABLE_EXIT_CODE = 42
_FORMAT = _checkpoint_file.FORMAT


P = ParamSpec("P")
R = TypeVar("R")


def _collective(strategy: Strategy | None, where: str) -> MultiWorkerMirroredExtended | None:
    """The MultiWorkerMirroredStrategy a checkpoint call talks through (then a collective), or None (local).

    Taken from the caller: ``strategy`` when the Checkpoint was given one, else the strategy whose scope is
    current, else the one MultiWorkerMirroredStrategy of this process not yet shut down (none: a local
    checkpoint). A strategy other than MultiWorkerMirrored has nothing to agree with: local.

    Raises:
        ValueError: ``strategy`` was shut down, or two or more MultiWorkerMirroredStrategy instances are live
            and the call names none (no ``strategy=``, no scope): which group to talk through is ambiguous.
    """
    if strategy is None and ts_context.has_strategy():
        strategy = ts_context.get_strategy()
    if strategy is not None:
        ext = strategy.extended
        if not isinstance(ext, MultiWorkerMirroredExtended):
            return None
        if ext._closed:
            raise ValueError(f"{where}: the strategy {strategy!r} was shut down; a checkpoint talks through a live "
                             "MultiWorkerMirroredStrategy")
        return ext
    live = live_extendeds()
    if len(live) > 1:
        raise ValueError(
            f"{where}: {len(live)} MultiWorkerMirroredStrategy instances are live and the call names none, so which "
            "workers take part is ambiguous: pass Checkpoint(..., strategy=s), or call it inside s.scope()")
    return live[0] if live else None


class Checkpoint:
    """Groups the objects to save; ints are kept as attributes (``ckpt.step``).

    What each kind saves: a module its ``state_dict`` under the buffer rule (floating buffers are ON_READ /
    MEAN: the cross-worker mean; integer buffers must be equal on every worker, else a ValueError names
    the buffer), the same whichever worker writes; an optimizer, an LR scheduler, a ``GradScaler``, a
    distributed dataset (its position and seed) or any object with ``state_dict`` / ``load_state_dict``:
    that state; :class:`RandomState` and a ``torch.Generator``: EVERY worker's state, each restored to the
    worker of the same rank; a ``ts.Variable`` its (ON_READ: aggregated) value; an int itself.

    Every save also holds every worker's :class:`RandomState` (torch, CUDA, numpy, Python's ``random``),
    and every restore gives each worker its own back, so dropout and random augmentation resume exactly;
    ``save_random_state=False`` leaves the random state out (e.g. to restore weights for evaluation
    without touching it). :meth:`state_dict` (for DCP) holds only the named objects: pass
    ``rng=RandomState()`` to put the random state there.

    Args:
        save_random_state: keyword-only: save and restore the random state of every worker (default True).
        strategy: keyword-only: the strategy whose workers save and restore together. Default: the one
            whose scope is current at each call, else the one MultiWorkerMirroredStrategy alive (a
            ValueError when two are alive and the call names neither), else none (a local checkpoint).
        **objects: modules, optimizers, LR schedulers, ``torch.amp.GradScaler``, distributed datasets,
            :class:`RandomState`, ``torch.Generator``, ``ts.Variable``, other objects with ``state_dict`` and
            ``load_state_dict``, or ``int`` values.

    Raises:
        TypeError: an object it cannot save, naming it and what it accepts.

    Example:
        >>> model = torch.nn.Linear(1, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        >>> ckpt = Checkpoint(model=model, optimizer=opt, sched=sched, rng=RandomState(), step=3)
        >>> ckpt.step
        3
    """

    def __init__(self, *, save_random_state: bool = True, strategy: Strategy | None = None, **objects: object):
        if not isinstance(save_random_state, bool):
            raise TypeError(f"Checkpoint: save_random_state must be True or False, got {save_random_state!r}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"Checkpoint: strategy must be a torchstrategies Strategy, got {strategy!r}")
        self._save_random_state = save_random_state
        self._strategy = strategy
        self._objects: dict[str, Any] = {}
        self._kinds: dict[str, str] = {}
        self._ints: dict[str, int] = {}
        for name, obj in objects.items():
            kind = kind_of(name, obj)
            if kind == "int":
                self._ints[name] = int(cast(int, obj))
            else:
                self._objects[name] = obj
                self._kinds[name] = kind

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

    def _collective(self, where: str) -> MultiWorkerMirroredExtended | None:
        """The MultiWorkerMirroredStrategy this call talks through (:func:`_collective`), or None."""
        return _collective(self._strategy, f"Checkpoint {where}")

    # --- state -------------------------------------------------------------------------------------------
    def _value(self, ext: MultiWorkerMirroredExtended | None, name: str, obj: Any) -> Any:
        """What is saved of ``obj`` (of a per-rank object: every rank's bytes, in rank order)."""
        kind = self._kinds[name]
        if kind == "module":
            return job_module_state(ext, name, obj)
        if kind == "variable":
            return read_variable(ext, obj)
        if kind == "per_rank":
            return gather_per_rank(ext, to_bytes(per_rank_state(obj)))
        if kind == "dataset":
            return list(obj.position)
        return obj.state_dict()  # optimizer, stateful

    def _state(self, ext: MultiWorkerMirroredExtended | None) -> dict[str, Any]:
        objects = {name: {"kind": self._kinds[name], "state": self._value(ext, name, obj)}
                   for name, obj in self._objects.items()}
        state: dict[str, Any] = {"format": _FORMAT, "ints": dict(self._ints), "objects": objects}
        if self._save_random_state:
            state["random_state"] = gather_per_rank(ext, to_bytes(RandomState().state_dict()))
        return state

    def _load(self, targets: dict[str, Any], values: dict[str, Any], ints: dict[str, Any], where: str,
              random_state: list[bytes] | None = None) -> None:
        """Checks every value against its object, then loads them: a failed check changes nothing."""
        self._check(targets, values, ints, where, random_state)
        ext = self._collective(where)
        # What may still refuse its state (objects checkpoint.py cannot look into) goes first, undone if it does.
        order = sorted(targets, key=lambda n: self._kinds[n] not in ("stateful", "dataset"))
        undo: list[Callable[[], object]] = []
        for name in order:
            obj, kind, value = targets[name], self._kinds[name], values[name]
            if kind == "per_rank":
                restore_per_rank(name, obj, value, ext)
            elif kind == "variable":
                restore_variable(ext, obj, value)
            elif kind in ("stateful", "dataset"):
                as_position = isinstance(value, list) and hasattr(obj, "restore_position")
                before = list(obj.position) if as_position else copy.deepcopy(obj.state_dict())
                try:
                    if as_position:
                        obj.restore_position(*value)  # a dataset position as checkpoints before state_dict kept it
                    else:
                        obj.load_state_dict(value)
                except Exception as exc:
                    for u in reversed(undo):
                        u()
                    raise CheckpointError(f"checkpoint {where}: {name} refused its saved state ({exc}); nothing "
                                          "was restored") from exc
                undo.append(functools.partial(obj.restore_position, *before) if as_position
                            else functools.partial(obj.load_state_dict, before))
            else:
                obj.load_state_dict(value)
        for k, v in ints.items():
            if k in self._ints:
                self._ints[k] = int(v)
        if random_state is not None:
            restore_per_rank("the random state", RandomState(), random_state, ext)

    def _check(self, targets: dict[str, Any], values: dict[str, Any], ints: dict[str, Any], where: str,
               random_state: list[bytes] | None) -> None:
        """Raises CheckpointError naming ``where`` and the first entry that cannot be restored."""
        missing = [n for n in targets if n not in values]
        if missing:
            raise CheckpointError(f"checkpoint {where} has no entry for {missing}")
        ext = self._collective(where)
        for name, obj in targets.items():
            why = check_restorable(name, self._kinds[name], obj, values[name], ext)
            if why:
                raise CheckpointError(f"checkpoint {where}: {name}: {why}")
        bad = [k for k, v in ints.items() if k in self._ints and (isinstance(v, bool) or not isinstance(v, int))]
        if bad:
            raise CheckpointError(f"checkpoint {where}: {bad[0]} is {ints[bad[0]]!r}, expected an int")
        if random_state is not None:
            why = check_restorable("the random state", "per_rank", RandomState(), random_state, ext)
            if why:
                raise CheckpointError(f"checkpoint {where}: the random state: {why}")

    def save(self, path: str) -> str:
        """Writes a checkpoint to ``path`` (chief only, atomically); a collective under MultiWorkerMirrored."""
        ext = self._collective(f"save to {path!r}")
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
        """Loads ``path`` into the objects (every worker reads); returns self.

        The file is read and checked first (its checksum, then every entry against its object: names, shapes,
        dtypes), so a damaged file or one of another model raises :class:`CheckpointError` naming the file
        and what is wrong, and changes nothing.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: the file is damaged, or does not fit the objects.
        """
        self._load_file(path, _checkpoint_file.read(path))
        return self

    def _load_file(self, path: str, state: dict[str, Any]) -> None:
        """Loads a state read from ``path`` (checked again: the check is cheap, the loading all or nothing)."""
        random_state = state.get("random_state") if self._save_random_state else None
        self._load(self._objects, self._saved_values(path, state), state["ints"], repr(path), random_state)

    def _check_file(self, path: str) -> dict[str, Any]:
        """The checked state of ``path`` (raises what :meth:`restore` would), changing nothing."""
        state = _checkpoint_file.read(path)
        random_state = state.get("random_state") if self._save_random_state else None
        self._check(self._objects, self._saved_values(path, state), state["ints"], repr(path), random_state)
        return state

    def _saved_values(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """What the file holds for each named object, saved as the same kind of object."""
        values = {}
        for name, entry in state["objects"].items():
            if name not in self._objects:
                continue
            kind = entry.get("kind") if isinstance(entry, dict) else None
            mine = self._kinds[name]
            if kind != mine and not (kind == "dataset" and hasattr(self._objects[name], "restore_position")):
                raise CheckpointError(f"checkpoint {path!r}: {name} was saved as a {kind}, is a {mine}")
            values[name] = entry["state"]
        return values

    read = restore

    # --- torch.distributed.checkpoint (DCP) ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state for ``torch.distributed.checkpoint`` (this makes a Checkpoint DCP-``Stateful``).

        Keys are the names given to the constructor; a module's value is its ``state_dict`` under the buffer
        rule, an optimizer's is ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (keyed
        by parameter names, as a DDP/FSDP job saves it; it needs the optimizer's module in the same
        Checkpoint), per-rank random state is every rank's (one bytes object). The same on every worker,
        so DCP writes each entry once. A collective under MultiWorkerMirroredStrategy.

        Example:
            >>> import torch.distributed.checkpoint as dcp                          # doctest: +SKIP
            >>> dcp.save(ckpt.state_dict(), checkpoint_id=path,                      # doctest: +SKIP
            ...          process_group=strategy.extended.process_group)
            >>> state = ckpt.state_dict()                                            # doctest: +SKIP
            >>> dcp.load(state, checkpoint_id=path, process_group=strategy.extended.process_group)  # doctest: +SKIP
            >>> ckpt.load_state_dict(state)                                          # doctest: +SKIP
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        ext = self._collective("state_dict")
        out: dict[str, Any] = dict(self._ints)
        for name, obj in self._objects.items():
            kind = self._kinds[name]
            if kind == "optimizer":
                out[name] = get_optimizer_state_dict(self._owner(name, obj), obj)
            elif kind == "per_rank":
                out[name] = to_bytes(self._value(ext, name, obj))  # one bytes object: DCP replaces it on load
            else:
                out[name] = self._value(ext, name, obj)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` gave (after ``torch.distributed.checkpoint.load`` filled it in)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        missing = [n for n in self._objects if n not in state]
        if missing:
            raise ValueError(f"Checkpoint.load_state_dict: the state has no entry for {missing}")
        rest = {n: o for n, o in self._objects.items() if self._kinds[n] != "optimizer"}
        values = {n: from_bytes(state[n]) if self._kinds[n] == "per_rank" else state[n] for n in rest}
        ints = {k: state[k] for k in self._ints if k in state}
        where = "given to load_state_dict"
        self._check(rest, values, ints, where, None)  # before anything is loaded, optimizers included
        for name, obj in self._objects.items():
            if self._kinds[name] == "optimizer":
                set_optimizer_state_dict(self._owner(name, obj), obj, state[name])
        self._load(rest, values, ints, where)

    def _owner(self, name: str, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The module of this checkpoint that holds every parameter of ``optimizer``."""
        wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for obj in self._objects.values():
            if isinstance(obj, torch.nn.Module) and wanted <= {id(p) for p in obj.parameters()}:
                return obj
        raise ValueError(f"Checkpoint.state_dict: optimizer {name} needs its module in the same Checkpoint "
                         "(DCP keys optimizer state by parameter name)")


def read_state(path: str) -> dict[str, Any]:
    """The state a checkpoint file holds, checked (what ``torch.load`` of the file gave before the checksum).

    The file is a 48-byte header (magic, payload length, SHA-256 of the payload) and ``torch.save``'s bytes of
    ``{"format", "ints", "objects": {name: {"kind", "state"}}, "random_state"}``, decoded with
    ``weights_only=True``.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is empty, truncated, changed after it was written, or not a checkpoint.

    Example:
        >>> import tempfile
        >>> path = Checkpoint(step=2, save_random_state=False).save(os.path.join(tempfile.mkdtemp(), "c.pt"))
        >>> read_state(path)["ints"]
        {'step': 2}
    """
    return _checkpoint_file.read(path)


def _atomic_save(state: dict[str, Any], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_temporaries(directory, f".{glob.escape(os.path.basename(path))}.tmp-*")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            _checkpoint_file.write(f, state)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _remove_temporaries(directory: str, pattern: str) -> None:
    """Removes what saves killed mid-write left in ``directory`` (``pattern``: a glob of their names)."""
    for tmp in glob.glob(os.path.join(glob.escape(directory), pattern)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
            log.info("removed %s, left by an interrupted save", tmp)


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
        return [p for _, p in self._numbered()]

    def _numbered(self) -> list[tuple[int, str]]:
        """(number, path) of every checkpoint ``<name>-<number>.pt`` in the directory, oldest first (never the
        temporaries of saves, ``.<name>-<number>.pt.tmp-*``)."""
        pat = re.compile(re.escape(self.checkpoint_name) + r"-(\d+)\.pt")
        found = []
        for p in glob.glob(os.path.join(glob.escape(self.directory), f"{glob.escape(self.checkpoint_name)}-*.pt")):
            m = pat.fullmatch(os.path.basename(p))
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

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
        ext = self.checkpoint._collective(f"save to {path!r}")
        if ext is None or ext.should_checkpoint:
            _remove_temporaries(self.directory, f".{glob.escape(self.checkpoint_name)}-*.pt.tmp-*")
            _remove_temporaries(self.directory, "checkpoint.tmp-*")
        self.checkpoint.save(path)
        if (ext is None or ext.should_checkpoint) and self.max_to_keep is not None:
            for old in self.checkpoints[:-self.max_to_keep]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)
            _atomic_write_text(os.path.join(self.directory, "checkpoint"),
                               json.dumps({"latest": os.path.basename(path)}))
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the newest checkpoint that loads; returns its path (None if there is none).

        A checkpoint that fails :meth:`Checkpoint.restore`'s checks (damaged, of another model) is skipped with
        a warning naming it and why, and the next older one is tried. Under MultiWorkerMirroredStrategy every
        worker restores the same one: the newest that every worker could check (one tiny all-reduce per
        round), or none.
        """
        ext = self.checkpoint._collective(f"restore from {self.directory!r}")
        numbered = self._numbered()
        bound: int | None = None
        while True:
            number, path, state = self._newest_good(numbered, bound)
            if ext is None:
                break
            mine = torch.tensor([number, -number], dtype=torch.int64, device=ext.worker_devices[0])
            low, neg_high = (int(v) for v in ext.all_reduce_tensors("min", [mine])[0].tolist())
            if low == -neg_high:  # every worker chose the same one (or none: -1)
                break
            if number > low:
                log.warning("another worker cannot restore %s: every worker takes %s", path,
                            f"checkpoint {low} or an older one" if low >= 0 else "none (a fresh start)")
            bound = low  # the newest some worker could check: everyone tries that one or an older one
            if low < 0:
                number, path, state = -1, None, None
                break
        if path is None or state is None:
            return None
        self.checkpoint._load_file(path, state)
        return path

    def _newest_good(self, numbered: list[tuple[int, str]], bound: int | None
                     ) -> tuple[int, str | None, dict[str, Any] | None]:
        """The newest checkpoint numbered at most ``bound`` that passes the checks: (number, path, state)."""
        for number, path in reversed(numbered):
            if bound is not None and number > bound:
                continue
            try:
                return number, path, self.checkpoint._check_file(path)
            except (CheckpointError, OSError) as exc:
                warnings.warn(f"CheckpointManager: skipping {path!r}, which cannot be restored: {exc}",
                              RuntimeWarning, stacklevel=3)
        return -1, None, None


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
        ext = self.manager.checkpoint._collective("preemption agreement")
        if ext is None:
            return self._requested
        flag = torch.tensor([1 if self._requested else 0], dtype=torch.int64, device=ext.worker_devices[0])
        return bool(ext.all_reduce_tensors("max", [flag])[0].item())

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Runs one step; saves and exits with ``exit_code`` afterwards if a stop was requested."""
        out = fn(*args, **kwargs)
        self.manager.checkpoint._ints["step"] += 1
        if self._agreed():
            path = self.manager.save()
            log.warning("saved %s at step %d; exiting with %d for a restart", path, self.total_run_calls,
                        self.exit_code)
            ext = self.manager.checkpoint._collective("preemption exit")
            if ext is not None:
                ext.shutdown()
            self._exit_fn(self.exit_code)
        return out

    def close(self) -> None:
        """Restores the previous signal handlers."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
