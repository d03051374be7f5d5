"""Cluster resolvers: who is in the cluster and which task this process is (``tf.distribute.cluster_resolver``).

A resolver answers TF's questions (``cluster_spec()``, ``task_type``, ``task_id``, ``master()``,
``num_accelerators()``) and the ones torch.distributed needs (``rank``, ``world_size``, ``local_rank``,
``local_world_size``, ``master_addr``, ``master_port``).

Global ranks follow one rule for every resolver: the jobs ``chief``, then ``ps``, then ``worker``, each in
task-index order (``evaluator`` tasks are outside the training world and have no rank). So with one chief,
two ps and three workers, ranks are chief:0 -> 0, ps:0 -> 1, ps:1 -> 2, worker:0 -> 3, ...

Launchers: torchrun (``TorchrunClusterResolver``), ``TF_CONFIG`` (``TFConfigClusterResolver``), SLURM's srun
(``SlurmClusterResolver``), Kubernetes (``KubernetesClusterResolver``: a Kubeflow PyTorchJob, a JobSet or an
indexed Job), or explicit values (``SimpleClusterResolver``).

Under torchrun (``TorchrunClusterResolver``) every process is a ``worker`` unless ``num_ps`` > 0, in which
case rank 0 is the ``chief``, ranks 1..num_ps are ``ps`` and the rest are ``worker`` (what
ParameterServerStrategy expects). torchrun does not tell a process the others' addresses, so the cluster
spec lists ``"rank:<r>"`` placeholders; ``master_addr``/``master_port`` are torchrun's rendezvous.

Example:
    >>> import torchstrategies as ts
    >>> r = ts.cluster_resolver.SimpleClusterResolver(
    ...     {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}, task_type="worker", task_id=1)
    >>> r.rank, r.world_size, r.master_addr, r.master_port
    (2, 3, 'h0', 2222)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ClusterSpec",
    "ClusterResolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "SlurmClusterResolver",
    "KubernetesClusterResolver",
    "expand_hostlist",
    "RANKED_JOBS",
]

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


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit values, as ``tf.distribute.cluster_resolver.SimpleClusterResolver``.

    Example:
        >>> SimpleClusterResolver({"worker": ["localhost:29500"]}, task_type="worker", task_id=0).rank
        0
    """

    def __init__(
        self,
        cluster_spec: Mapping[str, Sequence[str]] | ClusterSpec,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ):
        self._spec = ClusterSpec(cluster_spec)
        _check_task(self._spec, task_type, task_id, "SimpleClusterResolver")
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self.environment = environment
        self._num_accelerators = num_accelerators
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id)

    def _master_address(self) -> str:
        if self._master:
            return self._master.split("://", 1)[-1]
        return super()._master_address()


class TFConfigClusterResolver(SimpleClusterResolver):
    """Reads the ``TF_CONFIG`` environment variable, so TensorFlow users' cluster specs work unchanged.

    ``TF_CONFIG = {"cluster": {"chief": [...], "worker": [...], "ps": [...]}, "task": {"type": "worker",
    "index": 0}}``. The chief's (else worker 0's) address is the torch.distributed rendezvous.

    Example:
        >>> import json, os
        >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["localhost:29500"]},
        ...                                       "task": {"type": "worker", "index": 0}})
        >>> TFConfigClusterResolver().world_size
        1
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None,
                 environment: str | None = None):
        raw = os.environ.get("TF_CONFIG")
        if not raw:
            raise ValueError(
                "TFConfigClusterResolver: the TF_CONFIG environment variable is not set; set it to "
                '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}'
            )
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"TFConfigClusterResolver: TF_CONFIG is not valid JSON ({exc}): {raw!r}") from None
        if not isinstance(config, dict) or "cluster" not in config:
            raise ValueError(f"TFConfigClusterResolver: TF_CONFIG has no 'cluster' entry: {raw!r}")
        task = config.get("task") or {}
        ttype = task_type if task_type is not None else task.get("type")
        tid = task_id if task_id is not None else task.get("index")
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, int)):
            raise ValueError(
                f"TFConfigClusterResolver: TF_CONFIG task index {tid!r} is not an integer; write it as a JSON "
                'number, e.g. "task": {"type": "worker", "index": 0}'
            )
        _check_tf_cluster(config["cluster"])
        super().__init__(
            config["cluster"],
            task_type=ttype,
            task_id=tid,
            environment=environment if environment is not None else config.get("environment", ""),
            rpc_layer=rpc_layer if rpc_layer is not None else config.get("rpc_layer"),
        )


def _check_tf_cluster(cluster: object) -> None:
    """TF_CONFIG's cluster: every address HOST:PORT with a port in 1..65535, no address twice, one chief."""
    hint = 'e.g. {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}'
    if not isinstance(cluster, Mapping):
        raise ValueError(f"TFConfigClusterResolver: TF_CONFIG 'cluster' must map job names to address lists, "
                         f"got {cluster!r}; {hint}")
    seen: dict[str, str] = {}
    for job, tasks in cluster.items():
        addrs = list(tasks.values()) if isinstance(tasks, Mapping) else tasks
        if isinstance(addrs, str) or not isinstance(addrs, Sequence):
            raise ValueError(f"TFConfigClusterResolver: job {job!r} must list addresses, got {tasks!r}; {hint}")
        for i, addr in enumerate(addrs):
            where = f"{job}[{i}]"
            host, sep, port = str(addr).rpartition(":")
            if not sep or not host:
                raise ValueError(f"TFConfigClusterResolver: address {addr!r} of {where} has no port; "
                                 f"write HOST:PORT, {hint}")
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"TFConfigClusterResolver: address {addr!r} of {where} has port {port!r}, "
                                 f"expected a number in 1..65535; {hint}")
            if str(addr) in seen:
                raise ValueError(f"TFConfigClusterResolver: address {addr!r} is given twice ({seen[str(addr)]} "
                                 f"and {where}); every task needs its own HOST:PORT")
            seen[str(addr)] = where
    chiefs = cluster.get("chief", [])
    if isinstance(chiefs, (Sequence, Mapping)) and not isinstance(chiefs, str) and len(chiefs) > 1:
        raise ValueError(f"TFConfigClusterResolver: the cluster has {len(chiefs)} chief tasks {list(chiefs)}; "
                         "there is at most one chief (make the others workers)")


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchrunClusterResolver(ClusterResolver):
    """Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
    GROUP_RANK).

    Args:
        num_ps: how many ranks after the chief (rank 0) are parameter servers; 0 (the default) makes every
            rank a ``worker`` (the MultiWorkerMirroredStrategy layout).

    Raises:
        ValueError: a variable is missing or malformed (the message names it and how to launch).

    Example:
        >>> import os
        >>> os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        >>> TorchrunClusterResolver().task_type
        'worker'
    """

    def __init__(self, num_ps: int = 0):
        env = self._launch_env()
        missing = [v for v in _TORCHRUN_VARS if v not in env]
        if missing:
            raise ValueError(
                f"TorchrunClusterResolver: environment variable(s) {', '.join(missing)} not set: this process "
                f"was not started by torchrun. {_LAUNCH_HINT}"
            )
        values = {}
        for v in (*_TORCHRUN_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            if v == "MASTER_ADDR":
                continue
            raw = env.get(v)
            if raw is None:
                continue
            try:
                values[v] = int(raw)
            except ValueError:
                raise ValueError(f"TorchrunClusterResolver: {v}={raw!r} is not an integer. {_LAUNCH_HINT}") from None
        self._rank, self._world = values["RANK"], values["WORLD_SIZE"]
        if not 0 <= self._rank < self._world:
            raise ValueError(f"TorchrunClusterResolver: RANK={self._rank} is not in [0, WORLD_SIZE={self._world})")
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
            raise ValueError(f"num_ps must be a non-negative int, got {num_ps!r}")
        if num_ps and num_ps + 2 > self._world:
            raise ValueError(
                f"num_ps={num_ps} needs at least {num_ps + 2} ranks (a chief, the ps and a worker), "
                f"but WORLD_SIZE={self._world}"
            )
        self.num_ps = num_ps
        self._master_addr = env["MASTER_ADDR"]
        self._master_port = values["MASTER_PORT"]
        self._local_rank = values.get("LOCAL_RANK", 0)
        self._local_world = values.get("LOCAL_WORLD_SIZE", 1)
        if not 1 <= self._master_port <= 65535:
            raise ValueError(f"TorchrunClusterResolver: MASTER_PORT={self._master_port} is not a port in "
                             f"1..65535 (0 is not a rendezvous port). {_LAUNCH_HINT}")
        if not self._master_addr:
            raise ValueError(f"TorchrunClusterResolver: MASTER_ADDR is empty. {_LAUNCH_HINT}")
        if self._local_world < 1 or not 0 <= self._local_rank < self._local_world:
            raise ValueError(f"TorchrunClusterResolver: LOCAL_RANK={self._local_rank} is not in "
                             f"[0, LOCAL_WORLD_SIZE={self._local_world}). {_LAUNCH_HINT}")
        self.group_rank = values.get("GROUP_RANK", 0)
        if self.num_ps:
            n_workers = self._world - 1 - self.num_ps
            self._spec = ClusterSpec({
                "chief": ["rank:0"],
                "ps": [f"rank:{r}" for r in range(1, 1 + self.num_ps)],
                "worker": [f"rank:{r}" for r in range(1 + self.num_ps, 1 + self.num_ps + n_workers)],
            })
        else:
            self._spec = ClusterSpec({"worker": [f"rank:{r}" for r in range(self._world)]})

    def _launch_env(self) -> Mapping[str, str]:
        """The torchrun variables, as this launcher provides them (here: the environment itself)."""
        return os.environ

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    @property
    def task_type(self) -> str:
        if not self.num_ps:
            return "worker"
        if self._rank == 0:
            return "chief"
        return "ps" if self._rank <= self.num_ps else "worker"

    @property
    def task_id(self) -> int:
        if not self.num_ps:
            return self._rank
        if self._rank == 0:
            return 0
        return self._rank - 1 if self._rank <= self.num_ps else self._rank - 1 - self.num_ps

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world

    @property
    def master_addr(self) -> str:
        return self._master_addr

    @property
    def master_port(self) -> int:
        return self._master_port

    def _master_address(self) -> str:
        return f"{self._master_addr}:{self._master_port}"


# ------------------------------------------------------------------------------------------------ SLURM
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


# ------------------------------------------------------------------------------------------- Kubernetes
class KubernetesClusterResolver(TorchrunClusterResolver):
    """One process per pod on Kubernetes: a Kubeflow ``PyTorchJob``, a ``JobSet`` or an indexed ``Job``.

    * PyTorchJob: the training operator sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
      in every pod (the master pod is rank 0).
    * JobSet / indexed Job: the rank is the pod's ``JOB_COMPLETION_INDEX`` (Kubernetes sets it in an indexed
      Job's pods) unless ``RANK`` is set; ``WORLD_SIZE`` is the Job's completions (set it in the pod spec);
      ``MASTER_ADDR`` is pod 0's DNS name, else it is derived from ``JOBSET_NAME`` and ``REPLICATED_JOB_NAME``
      (expose the labels ``jobset.sigs.k8s.io/jobset-name`` and ``replicatedjob-name`` through the downward
      API) as JobSet names pods: ``<jobset>-<replicated job>-0-0.<subdomain>`` (``JOBSET_SUBDOMAIN``, default
      the JobSet's name); ``MASTER_PORT`` defaults to ``port``.

    Pods that run torchrun themselves (a PyTorchJob with ``nprocPerNode``) use ``TorchrunClusterResolver``.

    Args:
        num_ps: as for ``TorchrunClusterResolver``.
        port: the rendezvous port when ``MASTER_PORT`` is not set.
        environ: the environment to read (default ``os.environ``).

    Example:
        >>> env = {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "4", "JOBSET_NAME": "train",
        ...        "REPLICATED_JOB_NAME": "workers"}
        >>> r = KubernetesClusterResolver(environ=env)
        >>> r.rank, r.world_size, r.master_addr, r.master_port
        (2, 4, 'train-workers-0-0.train', 29500)
    """

    def __init__(self, num_ps: int = 0, port: int = 29500, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        rank = env.get("RANK") or env.get("JOB_COMPLETION_INDEX")
        master = env.get("MASTER_ADDR")
        if not master and env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME"):
            jobset = env["JOBSET_NAME"]
            master = f"{jobset}-{env['REPLICATED_JOB_NAME']}-0-0.{env.get('JOBSET_SUBDOMAIN') or jobset}"
        needed = (("RANK or JOB_COMPLETION_INDEX", rank), ("WORLD_SIZE", env.get("WORLD_SIZE")),
                  ("MASTER_ADDR or JOBSET_NAME + REPLICATED_JOB_NAME", master))
        missing = [name for name, value in needed if not value]
        if missing:
            raise ValueError(f"KubernetesClusterResolver: {', '.join(missing)} not set: run the pods as a Kubeflow "
                             "PyTorchJob (which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or as a JobSet / "
                             "indexed Job with WORLD_SIZE and MASTER_ADDR (or JOBSET_NAME, REPLICATED_JOB_NAME) "
                             "in the pod spec")
        self._env = {"RANK": str(rank), "WORLD_SIZE": env["WORLD_SIZE"], "MASTER_ADDR": str(master),
                     "MASTER_PORT": env.get("MASTER_PORT") or str(port), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        super().__init__(num_ps)

    def _launch_env(self) -> Mapping[str, str]:
        return self._env
