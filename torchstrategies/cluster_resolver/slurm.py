"""SLURM: its compressed host lists and ``SlurmClusterResolver``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchstrategies.cluster_resolver.base import RANKED_JOBS
from torchstrategies.cluster_resolver.simple import SimpleClusterResolver

__all__ = ["SlurmClusterResolver", "expand_hostlist"]

def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list, expanded in order: ``"node[01-03,7],gpu5"`` -> ``node01 node02 node03
    node7 gpu5``. A range keeps its zero padding; several bracket groups in one name multiply out.

    >>> expand_hostlist("node[01-03,7],gpu5")
    ['node01', 'node02', 'node03', 'node7', 'gpu5']
    >>> expand_hostlist("r[1-2]n[8-9]")
    ['r1n8', 'r1n9', 'r2n8', 'r2n9']

    Raises:
        ValueError: unbalanced brackets, an empty name, or a range that runs backwards.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"host list {hostlist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            names.extend(_expand_name(hostlist[start:i].strip(), hostlist))
            start = i + 1
    if depth:
        raise ValueError(f"host list {hostlist!r}: unbalanced brackets")
    return names


def _expand_name(name: str, hostlist: str) -> list[str]:
    if not name:
        raise ValueError(f"host list {hostlist!r} has an empty host name")
    head, sep, rest = name.partition("[")
    if not sep:
        return [name]
    body, _, tail = rest.partition("]")
    out: list[str] = []
    for part in body.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"host list {hostlist!r}: {part!r} is not a number or a range a-b")
        if dash and int(hi) < int(lo):
            raise ValueError(f"host list {hostlist!r}: range {part!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi if dash else lo) + 1))
    return [head + n + t for n in out for t in _expand_name(tail, hostlist)] if tail else [head + n for n in out]


def _tasks_per_node(raw: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in raw.split(","):
        count, _, rep = part.partition("(x")
        if not count.isdigit() or (rep and not rep.rstrip(")").isdigit()):
            raise ValueError(f"SlurmClusterResolver: SLURM tasks per node {raw!r} is not like '2(x3),1'")
        counts += [int(count)] * (int(rep.rstrip(")")) if rep else 1)
    return counts


def _slurm(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise ValueError(f"SlurmClusterResolver: {' / '.join(names)} is not set: start each task with srun "
                     "(e.g. `srun --ntasks-per-node=2 python train.py` inside an sbatch allocation)")


class SlurmClusterResolver(SimpleClusterResolver):
    """A task of a SLURM job step started by ``srun`` (TF's ``SlurmClusterResolver``).

    Reads srun's variables: ``SLURM_PROCID`` (the rank), ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
    ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, expanded by
    :func:`expand_hostlist`) and ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``). Tasks fill the
    nodes in order (srun's block distribution); the i-th task on a node listens on ``port_base + i``. Task 0
    is the rendezvous (``master_addr``/``master_port``).

    Args:
        jobs: tasks per job, e.g. ``{"chief": 1, "ps": 1, "worker": 2}``, filled in rank order (chief, ps,
            worker); None: every task a ``worker``. The counts must add up to the step's tasks.
        port_base: the first task port on each node.

    Raises:
        ValueError: a variable is missing or malformed, or ``jobs`` does not fit the step (named).

    Example:
        >>> env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        ...        "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}
        >>> r = SlurmClusterResolver(environ=env)
        >>> r.rank, r.world_size, r.local_rank, r.master_addr, r.cluster_spec().task_address("worker", 3)
        (3, 4, 1, 'node01', 'node02:8889')
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = 8888, rpc_layer: str | None = None,
                 environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        try:
            rank = int(_slurm(env, "SLURM_PROCID"))
            world = int(_slurm(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
            self._local_rank = int(env.get("SLURM_LOCALID", "0"))
            node = int(env.get("SLURM_NODEID", "0"))
        except ValueError as exc:
            if "SlurmClusterResolver" in str(exc):
                raise
            raise ValueError(f"SlurmClusterResolver: a SLURM task variable is not an integer ({exc})") from None
        hosts = expand_hostlist(_slurm(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        per_node = _tasks_per_node(_slurm(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
        if len(per_node) != len(hosts) or sum(per_node) != world:
            raise ValueError(f"SlurmClusterResolver: {len(hosts)} nodes {hosts} with tasks per node {per_node} do "
                             f"not make the step's {world} tasks")
        if not 0 <= rank < world or not 0 <= node < len(hosts) or not 0 <= self._local_rank < per_node[node]:
            raise ValueError(f"SlurmClusterResolver: SLURM_PROCID={rank}, SLURM_NODEID={node}, "
                             f"SLURM_LOCALID={self._local_rank} do not fit {world} tasks on {hosts}")
        if isinstance(port_base, bool) or not isinstance(port_base, int) or not 1 <= port_base <= 65535 - max(per_node):
            raise ValueError(f"port_base must be a port leaving room for {max(per_node)} tasks, got {port_base!r}")
        self._local_world = per_node[node]
        addresses = [f"{h}:{port_base + i}" for h, n in zip(hosts, per_node, strict=True) for i in range(n)]
        counts = dict(jobs) if jobs is not None else {"worker": world}
        unknown = [j for j in counts if j not in RANKED_JOBS]
        if unknown or sum(counts.values()) != world or any(n < 0 for n in counts.values()):
            raise ValueError(f"SlurmClusterResolver: jobs {counts} must give {world} tasks to {RANKED_JOBS}")
        spec: dict[str, list[str]] = {}
        first = 0
        for job in RANKED_JOBS:
            if counts.get(job):
                spec[job] = addresses[first:first + counts[job]]
                if first <= rank < first + counts[job]:
                    task_type, task_id = job, rank - first
                first += counts[job]
        super().__init__(spec, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer, environment="slurm")

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world
