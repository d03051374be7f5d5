"""What ``torchstrategies.checkpoint`` reads and writes of each kind of object (the file format lives there).

* :class:`RandomState`: the random state of this process (torch CPU, every CUDA device when present, numpy
  when installed, Python's ``random``), a per-rank object.
* :func:`job_module_state`: a module's ``state_dict`` under the buffer rule (floating buffers ON_READ /
  MEAN, integer buffers equal on every replica), the same on every rank.
* :func:`gather_per_rank`: every rank's bytes, in rank order, on every rank.
* :func:`kind_of`: which kind an object is, or the TypeError naming it and what a checkpoint accepts;
  ``ts.Variable`` reads and restores (TF's ON_READ rules).
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from torchstrategies.distribute.agreement import RankAgreement
from torchstrategies.distribute.buffers import is_mean_buffer

__all__ = ["RandomState", "job_module_state", "gather_per_rank", "to_bytes", "from_bytes", "kind_of", "per_rank_state",
           "restore_per_rank", "read_variable", "restore_variable"]

log = logging.getLogger("torchstrategies.checkpoint")


class Collective(Protocol):
    """What the checkpoint needs of a MultiWorkerMirroredStrategy's extended (its process group's calls)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def worker_devices(self) -> tuple[torch.device, ...]: ...

    def all_reduce_tensors(self, op: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None: ...

    def all_gather_parts(self, t: torch.Tensor) -> list[torch.Tensor]: ...


class RandomState:
    """The random state of this process, for ``Checkpoint(rng=RandomState())``; saved and restored per rank.

    Holds nothing itself: ``state_dict()`` reads the generators as they are now, ``load_state_dict()`` sets
    them: torch's CPU generator, every CUDA device's (when CUDA is available), numpy's global
    ``np.random`` (when numpy is installed) and Python's ``random``. A ``torch.Generator`` of your own
    (a DataLoader's, say) goes into the checkpoint by itself: ``Checkpoint(gen=my_generator)``.

    Example:
        >>> import random
        >>> rng = RandomState()
        >>> saved = rng.state_dict()
        >>> a = (torch.rand(1), random.random())
        >>> rng.load_state_dict(saved)
        >>> (torch.rand(1), random.random()) == a
        True
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"torch": torch.get_rng_state(),
                                 "python": {"version": version, "internal": list(internal), "gauss_next": gauss}}
        if torch.cuda.is_available():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        np = _numpy()
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                              "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if len(cuda) != torch.cuda.device_count():
                raise ValueError(f"the checkpoint holds the random state of {len(cuda)} CUDA devices, this process "
                                 f"sees {torch.cuda.device_count()}")
            torch.cuda.set_rng_state_all(cuda)
        np = _numpy()
        saved_np = state.get("numpy")
        if np is not None and saved_np is not None:
            np.random.set_state((saved_np["name"], saved_np["keys"].numpy().astype("uint32"), saved_np["pos"],
                                 saved_np["has_gauss"], saved_np["cached_gaussian"]))

    def __repr__(self) -> str:
        return "RandomState()"


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional: without it there is no numpy state to keep
        return None
    return numpy


def to_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def gather_per_rank(ext: Collective | None, blob: bytes) -> list[bytes]:
    """Every rank's ``blob`` in rank order, on every rank (an all-gather: the lengths, then the padded bytes)."""
    if ext is None:
        return [blob]
    device = ext.worker_devices[0]  # (NCCL gathers only tensors on the worker's GPU)
    mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    return [part.cpu().numpy().tobytes() for part in ext.all_gather_parts(mine.to(device))]


def job_module_state(ext: Collective | None, name: str, module: torch.nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` as the job holds it under the buffer rule, identical on every rank.

    Every persistent buffer is compared across ranks through the agreement seam (``distribute/agreement.py``:
    its hash, one small all-reduce): a buffer declared MEAN (``distribute/buffers.py``: norm layers' running
    statistics, ``ts.declare_buffer_aggregation``) that differs is replaced by its cross-rank mean (a second
    all-reduce, only then); any other buffer that differs raises. Buffers already equal on every rank are
    saved as they are, bit for bit.

    Raises:
        ReplicaDivergenceError: a buffer not declared MEAN (e.g. ``num_batches_tracked``) differs between
            ranks, naming it and the ranks.
    """
    sd = module.state_dict()
    if ext is None:
        return sd
    keys = [k for k, _ in module.named_buffers() if k in sd]  # the persistent ones
    if not keys:
        return sd
    ranks = RankAgreement(ext.all_reduce_tensors, ext.rank, ext.world_size, ext.worker_devices[0])
    differ = [keys[i] for i in ranks.differing([sd[k].detach() for k in keys])]
    for k in differ:
        owner, _, local = k.rpartition(".")
        if not is_mean_buffer(module.get_submodule(owner), local):
            ranks.raise_for([(f"{name}.{k}", sd[k])], "a checkpoint save", lambda _: _UNDECLARED)
    if differ:
        means = ext.all_reduce_tensors("mean", [sd[k].detach() for k in differ])
        sd = dict(sd)
        for k, m in zip(differ, means):
            sd[k] = m.to(sd[k].device)
    return sd


_UNDECLARED = ("the ranks wrote different values to a buffer not declared MEAN, which must agree on every "
               "replica. Write it from values that are the same on every rank, or, if its copies should be "
               "averaged (a running statistic), declare it: ts.declare_buffer_aggregation(module, name, 'mean')")


class Variable(Protocol):
    """What a checkpoint reads and writes of a ``ts.Variable``."""

    @property
    def synchronization(self) -> object: ...

    @property
    def aggregation(self) -> object: ...

    def read_value(self) -> object: ...

    def assign(self, value: torch.Tensor) -> object: ...


def is_variable(obj: object) -> bool:
    return hasattr(obj, "read_value") and hasattr(obj, "assign") and hasattr(obj, "synchronization")


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


_ACCEPTS = ("torch.nn.Module, torch.optim.Optimizer, an object with state_dict() and load_state_dict() (an LR "
            "scheduler, torch.amp.GradScaler, a distributed dataset, torchdata's StatefulDataLoader), "
            "ts.checkpoint.RandomState(), torch.Generator, ts.Variable or int")


def kind_of(name: str, obj: object) -> str:
    """How the checkpoint keeps ``obj`` (raises TypeError, naming it and what is accepted, if it cannot)."""
    if isinstance(obj, bool):
        raise TypeError(f"Checkpoint: {name}={obj!r} is a bool; it accepts {_ACCEPTS}")
    if isinstance(obj, int):
        return "int"
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (RandomState, torch.Generator)):
        return "per_rank"
    if is_variable(obj):
        return "variable"
    if is_stateful(obj):
        return "stateful"
    if hasattr(obj, "restore_position"):
        return "dataset"
    hint = ""
    if isinstance(obj, torch.utils.data.DataLoader):
        hint = " (for a DataLoader, pass strategy.experimental_distribute_dataset(loader): it keeps its position)"
    raise TypeError(f"Checkpoint: {name}={type(obj).__name__} cannot be saved{hint}; it accepts {_ACCEPTS}")


def rank_world(ext: Collective | None) -> tuple[int, int]:
    return (0, 1) if ext is None else (ext.rank, ext.world_size)


def per_rank_state(obj: RandomState | torch.Generator) -> object:
    return obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()


def restore_per_rank(name: str, obj: RandomState | torch.Generator, ranks: list[bytes],
                     ext: Collective | None) -> None:
    """Gives this rank its own saved state (a different world size: rank ``r`` takes ``r % saved``'s)."""
    rank, world = rank_world(ext)
    if len(ranks) != world:
        log.warning("Checkpoint: %s was saved by %d ranks, restored on %d: rank %d takes saved rank %d's state "
                    "(random draws go on, but not as any uninterrupted run)", name, len(ranks), world, rank,
                    rank % len(ranks))
    state = from_bytes(ranks[rank % len(ranks)])
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


def read_variable(ext: Collective | None, v: Variable) -> torch.Tensor:
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


def restore_variable(ext: Collective | None, v: Variable, value: torch.Tensor) -> None:
    sync = getattr(v.synchronization, "name", str(v.synchronization))
    agg = getattr(v.aggregation, "name", str(v.aggregation))
    if ext is not None and sync == "ON_READ" and agg == "SUM":
        value = value / ext.world_size  # TF: each replica holds value / num_replicas so the sum reads back
    v.assign(value)


# --- what a restore checks before it changes anything ------------------------------------------------------
def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_restorable(name: str, kind: str, obj: Any, value: Any, ext: Collective | None) -> str:
    """Why ``value`` (saved for ``name``) cannot be restored into ``obj``, or ``""``; reads, never writes.

    A module: the same keys, and every tensor the same shape and dtype ("parameter 2.bias: saved (4,),
    model (8,)"); an optimizer: the same parameter groups and sizes, and state tensors the shape of the live
    state's (a fresh ``torch.optim`` optimizer: broadcastable to their parameter's); a variable: its shape
    and dtype; per-rank state: decodable, of this generator's size; a dataset position: two ints.
    """
    if kind == "module":
        return _module_problem(obj, value)
    if kind == "optimizer":
        return _optimizer_problem(obj, value)
    if kind == "variable":
        live = torch.as_tensor(obj.read_value())
        if not isinstance(value, torch.Tensor):
            return f"saved a {type(value).__name__}, expected a tensor"
        if _shape(value) != _shape(live) or value.dtype != live.dtype:
            return f"saved {_shape(value)} {value.dtype}, variable {_shape(live)} {live.dtype}"
        return ""
    if kind == "per_rank":
        return _per_rank_problem(obj, value, ext)
    if kind == "dataset" or (isinstance(value, list) and hasattr(obj, "restore_position")):
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)):
            return f"saved {value!r}, expected a position [epoch, consumed]"
        return ""
    return ""  # any other object with load_state_dict: only it can tell (loaded first, undone if it refuses)


def _module_problem(module: torch.nn.Module, saved: Any) -> str:
    if not isinstance(saved, dict):
        return f"saved a {type(saved).__name__}, expected a state_dict"
    live = module.state_dict()
    missing = [k for k in live if k not in saved]
    extra = [k for k in saved if k not in live]
    if missing or extra:
        return (f"the checkpoint lacks {missing[:5]} and has {extra[:5]} that the model lacks" if missing and extra
                else f"the checkpoint lacks {missing[:5]}" if missing else f"the model lacks {extra[:5]}")
    params = {k for k, _ in module.named_parameters()}
    for k, t in live.items():
        s = saved[k]
        what = "parameter" if k in params else "buffer"
        if isinstance(t, torch.Tensor) != isinstance(s, torch.Tensor):
            return f"{what} {k}: saved a {type(s).__name__}, model a {type(t).__name__}"
        if isinstance(t, torch.Tensor) and _shape(s) != _shape(t):
            return f"{what} {k}: saved {_shape(s)}, model {_shape(t)}"
        if isinstance(t, torch.Tensor) and s.dtype != t.dtype:
            return f"{what} {k}: saved {s.dtype}, model {t.dtype}"
    return ""


def _optimizer_problem(opt: torch.optim.Optimizer, saved: Any) -> str:
    if not (isinstance(saved, dict) and isinstance(saved.get("param_groups"), list)
            and isinstance(saved.get("state"), dict)):
        return "saved no optimizer state_dict (param_groups, state)"
    groups, live = saved["param_groups"], opt.param_groups
    if len(groups) != len(live):
        return f"saved {len(groups)} parameter groups, the optimizer has {len(live)}"
    params: dict[Any, torch.Tensor] = {}
    for i, (g, lg) in enumerate(zip(groups, live)):
        if len(g.get("params", ())) != len(lg["params"]):
            return (f"parameter group {i}: saved {len(g.get('params', ()))} parameters, the optimizer has "
                    f"{len(lg['params'])}")
        params.update(zip(g["params"], lg["params"]))
    # LBFGS keeps one flat state for all its parameters: only a live state says what its shapes are
    by_param = type(opt).__module__.startswith("torch.optim") and not isinstance(opt, torch.optim.LBFGS)
    for pid, st in saved["state"].items():
        p = params.get(pid)
        if p is None or not isinstance(st, dict):
            return f"state of parameter {pid!r}, which no parameter group holds"
        current = opt.state.get(p, {})
        for key, v in st.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            ref = current.get(key)
            if isinstance(ref, torch.Tensor):
                if _shape(v) != _shape(ref):
                    return f"state {key!r} of parameter {pid}: saved {_shape(v)}, optimizer {_shape(ref)}"
            elif by_param and (v.dim() != p.dim() or any(a not in (b, 1) for a, b in zip(v.shape, p.shape))):
                return f"state {key!r} of parameter {pid}: saved {_shape(v)}, parameter {_shape(p)}"
    return ""


def _per_rank_problem(obj: RandomState | torch.Generator, ranks: Any, ext: Collective | None) -> str:
    if not (isinstance(ranks, list) and ranks and all(isinstance(b, bytes) for b in ranks)):
        return "saved no per-rank states"
    rank, _ = rank_world(ext)
    try:
        state = from_bytes(ranks[rank % len(ranks)])
    except Exception as exc:  # noqa: BLE001 - a damaged state, whatever torch says of it
        return f"saved rank {rank % len(ranks)}'s state cannot be decoded ({type(exc).__name__})"
    mine = per_rank_state(obj)
    if isinstance(mine, torch.Tensor):  # a torch.Generator's
        if not isinstance(state, torch.Tensor) or _shape(state) != _shape(mine) or state.dtype != mine.dtype:
            return f"saved a generator state that is not this generator's ({_shape(mine)} {mine.dtype})"
        return ""
    assert isinstance(mine, dict)
    if not (isinstance(state, dict) and isinstance(state.get("torch"), torch.Tensor)
            and _shape(state["torch"]) == _shape(mine["torch"]) and isinstance(state.get("python"), dict)):
        return "saved a random state that is not torch's and Python's"
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) != torch.cuda.device_count():
        return (f"holds the random state of {len(cuda)} CUDA devices, this process sees "
                f"{torch.cuda.device_count()}")
    return ""
