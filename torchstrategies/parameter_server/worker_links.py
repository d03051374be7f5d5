"""The chief's one record of each worker task's current instance: :class:`WorkerLink`.

A worker task that restarts is a new instance (a new random id) at a new address. The chief talks to a
worker over two channels: the control channel (the Watch stream, heartbeats, shutdown; ``strategy.py``)
and the coordinator's work channel (setup and closures; ``coordinator.py``). Both follow one record per
worker, and every instance the chief has reached is a :class:`WorkerInstance` of its own with its own
``dead`` event:

* whoever finds an instance dead (a heartbeat that failed, a work call that broke, a setup that failed)
  marks THAT instance dead. An instance that has been replaced can no longer touch its successor: a late
  report about the old one marks only the old one.
* :meth:`WorkerLink.current` gives the live instance. When the current one is dead it moves to the newer
  instance the task published in the rendezvous store, opening that instance's control channel first, so
  the coordinator only ever runs closures on the instance that the heartbeats reach, and the worker's
  lease on the chief is kept whatever the coordinator is doing.

Before this record the two channels each reread the store on their own, and a heartbeat failure about the
old instance, arriving after the coordinator had reached the new one, made the coordinator drop the new one
and wait for yet another (issue 40).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from torchstrategies.parameter_server.rpc.client import RpcClient
from torchstrategies.parameter_server.rpc.rendezvous import Entry

__all__ = ["WorkerInstance", "WorkerLink"]

log = logging.getLogger("torchstrategies.parameter_server")


@dataclass(eq=False)
class WorkerInstance:
    """One instance of a worker task as the chief reached it: where it listens, its id, its control channel,
    and whether it has been found dead (``dead`` is never cleared: a task that comes back is a new instance)."""

    index: int
    address: str
    instance: str
    control: RpcClient
    dead: threading.Event = field(default_factory=threading.Event)

    def mark_dead(self, why: str) -> None:
        """This instance is gone (safe inside a gRPC callback: it closes nothing)."""
        if not self.dead.is_set():
            log.warning("worker:%d at %s is lost: %s", self.index, self.address, why)
        self.control.mark_broken(why)
        self.dead.set()


class WorkerLink:
    """Which instance of worker ``index`` the chief talks to (thread-safe).

    Args:
        first: the instance the chief reached at start-up.
        read_entry: reads the task's rendezvous entry (raises UnavailableError while it is missing, refused
            or stale).
        open_control: opens (handshake + Watch stream) the control channel to a published entry.
    """

    def __init__(self, first: WorkerInstance, read_entry: Callable[[int], Entry],
                 open_control: Callable[[int, Entry], RpcClient]):
        self.index = first.index
        self._latest = first
        self._read_entry = read_entry
        self._open_control = open_control
        self._lock = threading.Lock()
        self._refused = ""

    @property
    def latest(self) -> WorkerInstance:
        """The newest instance reached (it may be dead and not yet replaced)."""
        return self._latest

    def current(self) -> WorkerInstance | None:
        """The live instance, moving to a newly published one when the latest is dead; ``None`` while the
        task has not come back (or its new entry is refused)."""
        with self._lock:
            latest = self._latest
            if not latest.dead.is_set():
                return latest
            try:
                entry = self._read_entry(self.index)
            except Exception as exc:  # noqa: BLE001 - refused, stale, or the store unreachable: not back yet
                if str(exc) != self._refused:
                    self._refused = str(exc)
                    log.warning("worker:%d: %s", self.index, exc)
                return None
            self._refused = ""
            if entry.instance == latest.instance:
                return None                          # the dead instance's entry: not back yet
            try:
                control = self._open_control(self.index, entry)
            except Exception as exc:  # noqa: BLE001 - published, then gone again (or not serving yet)
                log.info("worker:%d at %s: %s", self.index, entry.address, exc)
                return None
            latest.control.close()
            self._latest = WorkerInstance(self.index, entry.address, entry.instance, control)
            log.warning("worker:%d is back at %s; reconnected", self.index, entry.address)
            return self._latest

    def close(self) -> None:
        self._latest.control.close()
