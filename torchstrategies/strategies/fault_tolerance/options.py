"""``FaultTolerance``: the options of the fault-tolerant mode of MultiWorkerMirroredStrategy."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["FaultTolerance", "STORE_ENV", "WORKER_ENV", "JOB_ENV"]

STORE_ENV = "TORCHSTRATEGIES_FT_STORE"    # host:port of the TCPStore the launcher hosts
WORKER_ENV = "TORCHSTRATEGIES_FT_WORKER"  # this worker's slot (stable across its restarts)
JOB_ENV = "TORCHSTRATEGIES_FT_JOB"        # key prefix of the job in the store


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """How a fault-tolerant MultiWorkerMirrored job survives the loss of workers.

    Args:
        min_workers: below this many live workers the job stops with ``MembershipBelowMinimumError``.
        timeout_seconds: bound of every collective and of the step's commit: a frozen worker is dropped
            after it.
        world_size: the workers the first generation waits for (default: ``WORLD_SIZE``, else
            ``min_workers``); it forms with fewer (at least ``min_workers``) after ``timeout_seconds``.
        heartbeat_seconds: how often each worker writes its heartbeat to the store.
        dead_after_seconds: a worker missing from a new generation whose heartbeat did not move for this
            long is left out at once (SIGKILL costs this, not ``timeout_seconds``).
        store: ``"host:port"`` of the TCPStore that outlives the workers (the launcher's); default
            ``$TORCHSTRATEGIES_FT_STORE``.
        job: key prefix in the store (default ``$TORCHSTRATEGIES_FT_JOB`` or ``"job"``).

    Example:
        >>> import torchstrategies as ts
        >>> ts.FaultTolerance(min_workers=2, timeout_seconds=10.0).min_workers
        2
    """

    min_workers: int = 1
    timeout_seconds: float = 30.0
    world_size: int | None = None
    heartbeat_seconds: float = 0.1
    dead_after_seconds: float = 1.0
    store: str | None = None
    job: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_workers, int) or self.min_workers < 1:
            raise ValueError(f"FaultTolerance.min_workers must be an int >= 1, got {self.min_workers!r}")
        for name in ("timeout_seconds", "heartbeat_seconds", "dead_after_seconds"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"FaultTolerance.{name} must be a positive number of seconds, got {value!r}")
        if self.dead_after_seconds <= 2 * self.heartbeat_seconds:
            raise ValueError(f"FaultTolerance.dead_after_seconds ({self.dead_after_seconds}) must exceed two "
                             f"heartbeats ({2 * self.heartbeat_seconds})")

    def resolved_store(self) -> tuple[str, int]:
        """(host, port) of the store: ``store`` or ``$TORCHSTRATEGIES_FT_STORE``."""
        text = self.store if self.store is not None else os.environ.get(STORE_ENV)
        if not text or ":" not in text:
            raise ValueError(
                f"the fault-tolerant mode needs the address of a TCPStore that outlives the workers: pass "
                f"FaultTolerance(store='host:port') or set {STORE_ENV} (the launcher "
                f"`python -m torchstrategies.strategies.fault_tolerance.launch` sets it); got {text!r}")
        host, _, port = text.rpartition(":")
        return host, int(port)

    def resolved_world_size(self) -> int:
        if self.world_size is not None:
            return self.world_size
        return int(os.environ.get("WORLD_SIZE", self.min_workers))

    def resolved_job(self) -> str:
        return self.job if self.job is not None else os.environ.get(JOB_ENV, "job")
