"""The chief's one record of each worker task's current instance: :class:`WorkerLink`.

A worker task that restarts is a new instance (a new random id) at a new address. The chief talks to a
worker over two channels: the control channel (the Watch stream, heartbeats, shutdown; ``strategy.py``)
and the coordinator's work channel (setup and closures; ``coordinator.py``). Both follow one record per
worker, and every instance the chief has reached is a :class:`WorkerInstance` of its own with its own
``dead`` event:

* whoever finds an instance dead (a heartbeat that failed, a work call that broke, a setup that failed)
  marks THAT instance dead. An instance that has been replaced can no longer touch its successor: a late
  report about the old one marks only the old one.
* ONE path looks for the instance that replaces a dead one: the strategy's heartbeat loop calls
  :meth:`WorkerLink.find_successor` (once per heartbeat interval while the latest instance is dead), which
  reads the task's entry in the rendezvous store and, for a newer instance, opens its control channel first.
  The coordinator never looks: it waits in :meth:`WorkerLink.wait_live` for the instance the link moved
  to, so it only ever runs closures on the instance that the heartbeats reach, and the worker's lease on
  the chief is kept whether or not a coordinator exists.

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
        self._lock = threading.Lock()           # one look for a successor at a time
        self._moved = threading.Condition()     # notified when the link moves to a new instance
        self._refused = ""

    @property
    def latest(self) -> WorkerInstance:
        """The newest instance reached (it may be dead and not yet replaced)."""
        return self._latest

    def wait_live(self, after: WorkerInstance | None, timeout: float) -> WorkerInstance | None:
        """The latest instance once it is live and not ``after`` (the one the caller already used), waiting at
        most ``timeout`` seconds for the heartbeat loop to move the link; ``None`` if it did not."""
        with self._moved:
            self._moved.wait_for(lambda: not self._latest.dead.is_set() and self._latest is not after, timeout)
            latest = self._latest
        return latest if not latest.dead.is_set() and latest is not after else None

    def find_successor(self) -> WorkerInstance | None:
        """The live instance, moving to a newly published one when the latest is dead; ``None`` while the
        task has not come back (or its new entry is refused). Only the heartbeat loop calls it."""
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
            with self._moved:
                self._latest = WorkerInstance(self.index, entry.address, entry.instance, control)
                self._moved.notify_all()
            log.warning("worker:%d is back at %s; reconnected", self.index, entry.address)
            return self._latest

    def close(self) -> None:
        self._latest.control.close()
