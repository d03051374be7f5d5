"""What every cluster resolver is: ``ClusterSpec``, ``ClusterResolver`` and the one rank rule (chief, ps,
worker, each in task order)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ClusterSpec", "ClusterResolver", "RANKED_JOBS", "rank_of"]

RANKED_JOBS = ("chief", "ps", "worker")
_LAUNCH_HINT = (
    "Launch with torchrun, e.g. `torchrun --standalone --nproc_per_node=2 train.py` on one host, or "
    "`torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT train.py` on many"
)


class ClusterSpec:
    """Job name -> list of task addresses, as ``tf.train.ClusterSpec``.

    Example:
        >>> ClusterSpec({"worker": ["a:1", "b:1"]}).num_tasks("worker")
        2
    """

    def __init__(self, cluster: Mapping[str, Sequence[str]] | ClusterSpec | None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        cluster = cluster or {}
        if not isinstance(cluster, Mapping):
            raise TypeError(f"cluster spec must be a dict of job name -> list of addresses, got {cluster!r}")
        self._jobs: dict[str, list[str]] = {}
        for job, tasks in cluster.items():
            if isinstance(tasks, Mapping):  # TF allows {index: address}
                by_index: Mapping[Any, str] = tasks
                tasks = [by_index[k] for k in sorted(by_index, key=int)]
            if isinstance(tasks, str) or not isinstance(tasks, Sequence):
                raise TypeError(f"cluster spec job {job!r} must list addresses, got {tasks!r}")
            self._jobs[str(job)] = [str(t) for t in tasks]

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, []))

    def task_address(self, job: str, index: int) -> str:
        return self._jobs[job][index]

    def as_dict(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._jobs.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self._jobs!r})"


class ClusterResolver:
    """Base class: TF's resolver questions plus the torch.distributed view (rank, world size, master)."""

    rpc_layer: str | None = None

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    @property
    def task_type(self) -> str | None:
        raise NotImplementedError

    @property
    def task_id(self) -> int | None:
        raise NotImplementedError

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """Accelerators visible to this process, as TF reports them: ``{"GPU": n}`` (empty on CPU)."""
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": n} if n else {}

    # --- the torch.distributed view -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return rank_of(self.cluster_spec(), self.task_type, self.task_id)

    @property
    def world_size(self) -> int:
        spec = self.cluster_spec()
        return sum(spec.num_tasks(j) for j in RANKED_JOBS)

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    @property
    def master_addr(self) -> str:
        return _split_address(self._master_address())[0]

    @property
    def master_port(self) -> int:
        return _split_address(self._master_address())[1]

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The address of ``task_type:task_id`` (default: the chief, else worker 0), as TF's ``master()``."""
        if task_type is not None and task_id is not None:
            address = self.cluster_spec().task_address(task_type, task_id)
        else:
            address = self._master_address()
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def _master_address(self) -> str:
        spec = self.cluster_spec()
        for job in RANKED_JOBS:
            if spec.num_tasks(job):
                return spec.task_address(job, 0)
        raise ValueError(f"the cluster spec has no chief, ps or worker task: {spec!r}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
                f"rank={self.rank}, world_size={self.world_size})")


def rank_of(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> int:
    """Global rank of ``task_type:task_id`` by the chief, ps, worker ordering."""
    if task_type not in RANKED_JOBS:
        raise ValueError(
            f"task_type {task_type!r} has no rank in the training world (expected one of {RANKED_JOBS})"
        )
    if task_id is None or not 0 <= task_id < spec.num_tasks(task_type):
        raise ValueError(
            f"task_id {task_id!r} is out of range for job {task_type!r} with {spec.num_tasks(task_type)} tasks"
        )
    offset = 0
    for job in RANKED_JOBS:
        if job == task_type:
            return offset + task_id
        offset += spec.num_tasks(job)
    raise AssertionError("unreachable")


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host, int(port)


def _check_task(spec: ClusterSpec, task_type: str | None, task_id: int | None, where: str) -> None:
    if task_type is None:
        return
    if spec and task_type not in spec.jobs:
        raise ValueError(f"{where}: task type {task_type!r} is not a job of the cluster {spec.jobs}")
    if task_id is not None and spec and not 0 <= task_id < spec.num_tasks(task_type):
        raise ValueError(
            f"{where}: task index {task_id} is out of range for job {task_type!r} "
            f"with {spec.num_tasks(task_type)} tasks"
        )
