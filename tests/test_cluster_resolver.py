"""Cluster resolvers: TF's task layout mapped to torch.distributed ranks, and clear errors."""

from __future__ import annotations

import json

import pytest

from torchstrategies.cluster_resolver import (
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
)

PS_CLUSTER = {"chief": ["c:1000"], "ps": ["p0:1001", "p1:1002"], "worker": ["w0:1003", "w1:1004", "w2:1005"]}


@pytest.mark.parametrize(
    "task_type,task_id,rank",
    [("chief", 0, 0), ("ps", 0, 1), ("ps", 1, 2), ("worker", 0, 3), ("worker", 2, 5)],
)
def test_ranks_follow_chief_then_ps_then_worker(task_type, task_id, rank):
    r = SimpleClusterResolver(PS_CLUSTER, task_type=task_type, task_id=task_id)
    assert r.rank == rank
    assert r.world_size == 6
    assert (r.master_addr, r.master_port) == ("c", 1000)


def test_master_is_worker_zero_without_a_chief_and_rpc_layer_prefixes_it():
    r = SimpleClusterResolver({"worker": ["a:1", "b:2"]}, task_type="worker", task_id=1, rpc_layer="grpc")
    assert r.master() == "grpc://a:1"
    assert r.master("worker", 1) == "grpc://b:2"
    assert (r.rank, r.world_size) == (1, 2)


def test_simple_resolver_rejects_unknown_job_and_out_of_range_index():
    with pytest.raises(ValueError, match="'evaluator' is not a job"):
        SimpleClusterResolver({"worker": ["a:1"]}, task_type="evaluator", task_id=0)
    with pytest.raises(ValueError, match="task index 3 is out of range for job 'worker' with 1 tasks"):
        SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=3)


def test_cluster_spec_accepts_index_dicts_and_compares_by_value():
    assert ClusterSpec({"worker": {1: "b:1", 0: "a:1"}}).as_dict() == {"worker": ["a:1", "b:1"]}
    assert ClusterSpec({"worker": ["a:1"]}) == ClusterSpec(ClusterSpec({"worker": ["a:1"]}))
    with pytest.raises(TypeError, match="must list addresses"):
        ClusterSpec({"worker": "a:1"})


def test_tf_config_resolver_reads_cluster_and_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": PS_CLUSTER, "task": {"type": "worker", "index": 1}}))
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rank, r.world_size) == ("worker", 1, 4, 6)
    assert r.cluster_spec().num_tasks("ps") == 2


@pytest.mark.parametrize(
    "value,match",
    [(None, "TF_CONFIG environment variable is not set"), ("{not json", "not valid JSON"),
     ('{"task": {}}', "no 'cluster' entry")],
)
def test_tf_config_resolver_errors_name_the_problem(monkeypatch, value, match):
    if value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ValueError, match=match):
        TFConfigClusterResolver()


def _torchrun_env(monkeypatch, rank, world):
    for k, v in dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=29555, GROUP_RANK=0).items():
        monkeypatch.setenv(k, str(v))


def test_torchrun_resolver_makes_every_rank_a_worker(monkeypatch):
    _torchrun_env(monkeypatch, 2, 4)
    r = TorchrunClusterResolver()
    assert (r.task_type, r.task_id, r.rank, r.world_size, r.local_rank) == ("worker", 2, 2, 4, 2)
    assert (r.master_addr, r.master_port) == ("127.0.0.1", 29555)
    assert r.cluster_spec().num_tasks("worker") == 4


@pytest.mark.parametrize("rank,role", [(0, ("chief", 0)), (1, ("ps", 0)), (2, ("worker", 0)), (3, ("worker", 1))])
def test_torchrun_resolver_with_num_ps_assigns_chief_ps_workers(monkeypatch, rank, role):
    _torchrun_env(monkeypatch, rank, 4)
    r = TorchrunClusterResolver(num_ps=1)
    assert (r.task_type, r.task_id) == role
    assert r.rank == rank
    assert r.cluster_spec().as_dict() == {"chief": ["rank:0"], "ps": ["rank:1"], "worker": ["rank:2", "rank:3"]}


def test_torchrun_resolver_names_missing_variables_and_how_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set.*torchrun --standalone"):
        TorchrunClusterResolver()


def test_torchrun_resolver_rejects_bad_values(monkeypatch):
    _torchrun_env(monkeypatch, 0, 2)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        TorchrunClusterResolver()
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match=r"RANK=5 is not in \[0, WORLD_SIZE=2\)"):
        TorchrunClusterResolver()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="num_ps=1 needs at least 3 ranks"):
        TorchrunClusterResolver(num_ps=1)


# ------------------------------------------------------------------ SLURM and Kubernetes (issue 39)
from torchstrategies.cluster_resolver import (  # noqa: E402
    KubernetesClusterResolver,
    SlurmClusterResolver,
    expand_hostlist,
)


@pytest.mark.parametrize("hostlist, hosts", [
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("single", ["single"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("a[008-010]", ["a008", "a009", "a010"]),
    ("r[1-2]n[1,3]-ib,x", ["r1n1-ib", "r1n3-ib", "r2n1-ib", "r2n3-ib", "x"]),
])
def test_slurm_host_lists_expand_as_scontrol_show_hostnames_does(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "a,,b"])
def test_a_malformed_host_list_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def _srun_env(procid: int, ntasks: int = 5, nodelist: str = "node[01-02],gpu5",
              per_node: str = "2(x2),1") -> dict[str, str]:
    """What srun sets for task ``procid`` when tasks fill the nodes in order."""
    counts = [2, 2, 1]
    node = next(i for i in range(3) if procid < sum(counts[:i + 1]))
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
            "SLURM_NODEID": str(node), "SLURM_LOCALID": str(procid - sum(counts[:node])),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": "ignored[1-9]",
            "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": "9"}


def test_slurm_resolver_reads_sruns_variables_for_every_task():
    views = [SlurmClusterResolver(environ=_srun_env(p), port_base=7000) for p in range(5)]
    assert [v.rank for v in views] == [0, 1, 2, 3, 4]
    assert {v.world_size for v in views} == {5}
    assert [v.local_rank for v in views] == [0, 1, 0, 1, 0]
    assert [v.local_world_size for v in views] == [2, 2, 2, 2, 1]
    assert {(v.master_addr, v.master_port) for v in views} == {("node01", 7000)}
    assert views[0].cluster_spec().as_dict() == {
        "worker": ["node01:7000", "node01:7001", "node02:7000", "node02:7001", "gpu5:7000"]}
    assert views[3].master("worker", 3, "grpc") == "grpc://node02:7001"


def test_slurm_resolver_gives_jobs_in_rank_order_for_a_parameter_server_job():
    views = [SlurmClusterResolver(jobs={"worker": 3, "ps": 1, "chief": 1}, environ=_srun_env(p)) for p in range(5)]
    assert [(v.task_type, v.task_id) for v in views] == [
        ("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert [v.rank for v in views] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("change, match", [
    ({"SLURM_PROCID": None}, "SLURM_PROCID is not set"),
    ({"SLURM_STEP_NUM_TASKS": "6", "SLURM_NTASKS": "6"}, "do not make the step's 6 tasks"),
    ({"SLURM_PROCID": "x"}, "not an integer"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x", "SLURM_TASKS_PER_NODE": None}, "tasks per node"),
])
def test_slurm_resolver_names_what_is_wrong(change, match):
    env = _srun_env(1)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(ValueError, match=match):
        SlurmClusterResolver(environ=env)


def test_slurm_resolver_refuses_jobs_that_do_not_fit_the_step():
    with pytest.raises(ValueError, match="must give 5 tasks"):
        SlurmClusterResolver(jobs={"worker": 2}, environ=_srun_env(0))


def test_kubernetes_resolver_reads_a_pytorchjob_pods_environment():
    env = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "PYTHONUNBUFFERED": "1"}
    r = KubernetesClusterResolver(environ=env)
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size) == (1, 3, 0, 1)
    assert (r.master_addr, r.master_port, r.task_type, r.task_id) == ("job-master-0", 23456, "worker", 1)


def test_kubernetes_resolver_reads_a_jobset_pods_index_and_derives_the_master():
    env = {"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "4", "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "w",
           "JOBSET_SUBDOMAIN": "net"}
    r = KubernetesClusterResolver(num_ps=1, port=4000, environ=env)
    assert (r.rank, r.world_size, r.master_addr, r.master_port) == (3, 4, "train-w-0-0.net", 4000)
    assert (r.task_type, r.task_id) == ("worker", 1)


def test_kubernetes_resolver_says_what_a_pod_lacks():
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_ADDR or JOBSET_NAME"):
        KubernetesClusterResolver(environ={"JOB_COMPLETION_INDEX": "0"})


def _mwms_on(rank: int, world: int, launcher: str, port: int) -> float:
    import torch

    import torchstrategies as ts

    if launcher == "slurm":
        resolver = SlurmClusterResolver(port_base=port)
    else:
        resolver = KubernetesClusterResolver()
    strategy = ts.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    try:
        out = strategy.reduce("sum", strategy.run(lambda: torch.tensor(float(rank + 1))), axis=None)
        return float(out)
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["slurm", "kubernetes"])
def test_multi_worker_strategy_trains_under_a_simulated_launch(launcher):
    from harness import Rendezvous, run_ranks

    rdzv = Rendezvous()  # the store binds port 0 and hands its port on: no other process can take it first
    port = rdzv.port

    def env(rank: int) -> dict[str, str]:
        if launcher == "slurm":
            return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                    "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2"}
        return {"JOB_COMPLETION_INDEX": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}

    clear = {"RANK": "", "MASTER_ADDR": "127.0.0.1" if launcher == "kubernetes" else ""}
    with rdzv:
        out = run_ranks(_mwms_on, 2, args=(launcher, port), init_process_group=False, timeout=110,
                        env=clear, env_per_rank=env, rendezvous=rdzv)
    assert out == [3.0, 3.0]
