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

The package holds one file per launcher: ``base.py`` (``ClusterSpec``, ``ClusterResolver``, the rank rule),
``simple.py`` (explicit values, ``TF_CONFIG``), ``torchrun.py``, ``slurm.py`` (with SLURM's host lists) and
``kubernetes.py``.
"""

from __future__ import annotations

from torchstrategies.cluster_resolver.base import RANKED_JOBS, ClusterResolver, ClusterSpec
from torchstrategies.cluster_resolver.kubernetes import KubernetesClusterResolver
from torchstrategies.cluster_resolver.simple import SimpleClusterResolver, TFConfigClusterResolver
from torchstrategies.cluster_resolver.slurm import SlurmClusterResolver, expand_hostlist
from torchstrategies.cluster_resolver.torchrun import TorchrunClusterResolver

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
