"""The resolver of a torchrun launch (``TorchrunClusterResolver``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torchstrategies.cluster_resolver.base import _LAUNCH_HINT, ClusterResolver, ClusterSpec

__all__ = ["TorchrunClusterResolver"]

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
