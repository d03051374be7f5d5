"""Kubernetes, one process per pod (``KubernetesClusterResolver``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchstrategies.cluster_resolver.torchrun import TorchrunClusterResolver

__all__ = ["KubernetesClusterResolver"]

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
