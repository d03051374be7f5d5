"""What ``torchstrategies.checkpoint`` reads and writes of each kind of object (the file format lives there).

* :class:`RandomState`: the random state of this process (torch CPU, every CUDA device when present, numpy
  when installed, Python's ``random``), a per-rank object.
* :func:`job_module_state`: a module's ``state_dict`` under the buffer rule (floating buffers ON_READ /
  MEAN, integer buffers equal on every replica), the same on every rank.
* :func:`gather_per_rank`: every rank's bytes, in rank order, on every rank.
"""

from __future__ import annotations

import io
import random
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["RandomState", "job_module_state", "gather_per_rank", "to_bytes", "from_bytes"]


class Collective(Protocol):
    """What the checkpoint needs of a MultiWorkerMirroredStrategy's extended (its process group's calls)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_tensors(self, op: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


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
    """Every rank's ``blob`` in rank order, on every rank (two all-reduces: the longest length, the rows)."""
    if ext is None:
        return [blob]
    (longest,) = ext.all_reduce_tensors("max", [torch.tensor([len(blob)], dtype=torch.int64)])
    rows = torch.zeros(ext.world_size, int(longest.item()) + 1, dtype=torch.int32)
    rows[ext.rank, 0] = len(blob)
    rows[ext.rank, 1:1 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int32)
    (summed,) = ext.all_reduce_tensors("sum", [rows])  # each row has one writer: the sum is that rank's bytes
    return [bytes(summed[r, 1:1 + int(summed[r, 0])].to(torch.uint8).tolist()) for r in range(ext.world_size)]


def job_module_state(ext: Collective | None, name: str, module: torch.nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` as the job holds it under the buffer rule, identical on every rank.

    Every buffer is compared across ranks in one MAX all-reduce of ``(b, -b)``: an integer buffer that
    differs raises; a floating one that differs is replaced by its cross-rank mean (a second all-reduce,
    only then). Buffers already equal on every rank are saved as they are, bit for bit.

    Raises:
        ValueError: an integer buffer (e.g. ``num_batches_tracked``) differs between ranks, naming it.
    """
    sd = module.state_dict()
    if ext is None:
        return sd
    keys = [k for k, _ in module.named_buffers() if k in sd]  # the persistent ones
    if not keys:
        return sd
    probes = [_probe(sd[k].detach()) for k in keys]
    maxima = ext.all_reduce_tensors("max", [torch.stack([p, -p]) for p in probes])
    differ = []
    for k, m in zip(keys, maxima):
        if torch.equal(m[0], -m[1]):  # max == min: every rank holds the same value
            continue
        if not (sd[k].is_floating_point() or sd[k].is_complex()):
            raise ValueError(
                f"Checkpoint: integer buffer {name}.{k} differs between ranks (max {m[0].flatten()[:4].tolist()}, "
                f"min {(-m[1]).flatten()[:4].tolist()}): integer buffers must agree on every replica")
        differ.append(k)
    if differ:
        means = ext.all_reduce_tensors("mean", [sd[k].detach() for k in differ])
        sd = dict(sd)
        for k, m in zip(differ, means):
            sd[k] = m.to(sd[k].device)
    return sd


def _probe(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype where negation is exact and MAX is defined (int64 for integers and bools)."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.is_floating_point() else t.to(torch.int64)
