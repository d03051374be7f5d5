"""Resolvers from explicit values (``SimpleClusterResolver``) and from ``TF_CONFIG``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from torchstrategies.cluster_resolver.base import (
    ClusterResolver,
    ClusterSpec,
    _check_task,
)

__all__ = ["SimpleClusterResolver", "TFConfigClusterResolver"]

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
