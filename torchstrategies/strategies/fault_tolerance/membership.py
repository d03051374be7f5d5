"""Membership and agreement of a fault-tolerant job, kept in torch's TCPStore (no other server).

Keys (under the job's prefix):

* ``hb/<id>``: a worker's heartbeat counter, bumped every ``heartbeat_seconds`` by a thread on its own
  store connection (a blocking ``get`` of the main connection must not stop it).
* ``g<G>/n``, ``g<G>/r/<i>``: registrations for generation ``G`` ("<id> <committed steps>", -1: no state).
* ``g<G>/members``: the closed membership of generation ``G``, written once with ``compare_set``: every
  registrant closes it when its own view allows (every member of ``G-1`` registered, or silent for
  ``dead_after_seconds``, or ``timeout_seconds`` passed), and the first write wins. A registrant missing
  from the winner is *refused* (its generation is old) and joins the next one without state.
* No key for the commit of a step: a member applies step ``k`` when every collective of it completed on
  that member (the gradients' all-reduce and the agreement check's, ``loop.py``); one whose collective failed
  discards it, tears the group down so that its peers' collectives fail at once, and registers for ``G+1``
  with its committed steps. So the members of ``G`` may register with different counts (a step completed on
  some and failed on others); the new generation copies the state of the first member with the most steps
  to the others (``TransactionalLoop._heal``): every member of ``G`` with state holds ``G``'s state at its own
  step count, and a step applied by any member was an all-reduce over all of ``G``, so nothing is applied
  twice or lost. Joiners: the heartbeat thread counts the registrations for ``G+1`` (:meth:`Membership.joiners`);
  each member adds what it saw into the step's all-reduce, and every member reads the same sum.

A worker's identity is ``<slot>.<pid>.<random>``: a restarted worker is a new member.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import secrets
import threading
import time

import torch.distributed as dist

from torchstrategies.errors import UnavailableError
from torchstrategies.strategies.fault_tolerance.options import WORKER_ENV, FaultTolerance

__all__ = ["Generation", "Membership", "Refused", "connect"]

log = logging.getLogger("torchstrategies.multi_worker")


@dataclasses.dataclass(frozen=True)
class Generation:
    """A closed membership: ``members`` in order (a member's index is its rank in the generation's group),
    each member's committed steps when it registered (-1: no state), and this worker's index."""

    number: int
    members: tuple[str, ...]
    steps: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.members)


class Refused(Exception):
    """This worker registered for a generation that closed without it."""


def connect(options: FaultTolerance) -> dist.Store:
    """A client of the job's TCPStore, under the job's key prefix."""
    host, port = options.resolved_store()
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=options.timeout_seconds))
    except (RuntimeError, OSError) as exc:
        raise UnavailableError(f"fault-tolerant MultiWorkerMirrored: cannot reach the store at {host}:{port} "
                               f"({exc}); it must be hosted by a process that outlives the workers") from exc
    return dist.PrefixStore(f"torchstrategies/ft/{options.resolved_job()}/", store)


def _key_text(store: dist.Store, key: str) -> str:
    return bytes(store.get(key)).decode()


class Membership:
    """This worker's view of the job's membership (see the module docstring).

    Args:
        options: the job's ``FaultTolerance``.
    """

    def __init__(self, options: FaultTolerance) -> None:
        self.options = options
        self.store = connect(options)
        slot = os.environ.get(WORKER_ENV, os.environ.get("RANK", "0"))
        self.me = f"{slot}.{os.getpid()}.{secrets.token_hex(3)}"
        self._stop = threading.Event()
        self._watch: int | None = None           # the generation this worker is a member of
        self._joiners: tuple[int, int] = (0, 0)  # (generation, registrations for the next one)
        self._beat_store = connect(options)  # its own connection: never queued behind a blocking get
        self._beat_store.add(f"hb/{self.me}", 1)
        self._thread = threading.Thread(target=self._beat, name="torchstrategies-ft-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = f"hb/{self.me}"
        while not self._stop.wait(self.options.heartbeat_seconds):
            try:
                self._beat_store.add(key, 1)
                watch = self._watch
                if watch is not None:
                    self._joiners = (watch, int(self._beat_store.add(f"g{watch + 1}/n", 0)))
            except Exception:  # noqa: BLE001 - the store is gone; the main path reports it
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.options.heartbeat_seconds + 1)

    # --- generations --------------------------------------------------------------------------------------
    def latest(self) -> Generation | None:
        """The newest closed generation (None: none yet), seen from outside it (index -1)."""
        number = 0
        while self.store.check([f"g{number + 1}/members"]):
            number += 1
        if number == 0:
            return None
        ids, steps = self._parse(_key_text(self.store, f"g{number}/members"))
        return Generation(number, ids, steps, -1)

    @staticmethod
    def _parse(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        pairs = [item.split() for item in text.split(",") if item]
        return tuple(p[0] for p in pairs), tuple(int(p[1]) for p in pairs)

    def _registrations(self, number: int) -> list[str]:
        n = int(self.store.add(f"g{number}/n", 0))
        keys = [f"g{number}/r/{i}" for i in range(1, n + 1)]
        return [_key_text(self.store, k) for k in keys if self.store.check([k])]

    def form(self, number: int, previous: Generation | None, steps: int) -> Generation:
        """Registers for generation ``number`` with ``steps`` committed (-1: no state) and returns it once
        closed.

        Raises:
            Refused: it closed without this worker.
        """
        i = int(self.store.add(f"g{number}/n", 1))
        self.store.set(f"g{number}/r/{i}", f"{self.me} {steps}")
        key = f"g{number}/members"
        expected = previous.members if previous is not None else ()
        deadline = time.monotonic() + self.options.timeout_seconds
        self._formed_at = time.monotonic()
        beats: dict[str, tuple[int, float]] = {}
        while not self.store.check([key]):
            regs = self._registrations(number)
            stateless = all(int(r.split()[1]) < 0 for r in regs)
            if self._may_close([r.split()[0] for r in regs], expected, deadline if steps >= 0 else None, beats,
                               stateless and previous is not None):
                self.store.compare_set(key, "", ",".join(regs))
                break
            time.sleep(0.01)
        ids, got = self._parse(_key_text(self.store, key))
        if self.me not in ids:
            raise Refused(f"generation {number} closed without {self.me}")
        return Generation(number, ids, got, ids.index(self.me))

    def _may_close(self, ids: list[str], expected: tuple[str, ...], deadline: float | None,
                   beats: dict[str, tuple[int, float]], stateless: bool) -> bool:
        """Whether this registrant's view closes the generation: every expected member registered or silent
        for ``dead_after_seconds`` (``timeout_seconds`` when no registrant holds the state, so that a
        heartbeat starved on a loaded machine cannot make returning workers shut out the members that hold
        it); or the deadline passed (``None``: a registrant without state never closes on the deadline)."""
        now = time.monotonic()
        if not expected:  # the first generation: wait for the launch's workers
            return len(ids) >= self.options.resolved_world_size() or now >= self._start_deadline(deadline)
        if deadline is not None and now >= deadline:
            return True
        missing = [e for e in expected if e not in ids]
        for e in missing:
            k = f"hb/{e}"
            beat = int(self.store.add(k, 0))
            if e not in beats or beats[e][0] != beat:
                beats[e] = (beat, now)
        silent = self.options.timeout_seconds if stateless else self.options.dead_after_seconds
        return all(now - beats[e][1] >= silent for e in missing)

    def _start_deadline(self, deadline: float | None) -> float:
        return deadline if deadline is not None else self._formed_at + self.options.timeout_seconds

    def mark_state_exists(self) -> None:
        """Recorded once a generation holds the job's state (after its first heal)."""
        self.store.set("state", "1")

    def state_existed(self) -> bool:
        return bool(self.store.check(["state"]))

    def mark_finished(self, steps: int) -> None:
        """A member that holds the state ended its training at ``steps`` (``strategy.shutdown()``)."""
        self.store.set("finished", str(steps))

    def finished(self) -> int | None:
        return int(_key_text(self.store, "finished")) if self.store.check(["finished"]) else None

    # --- while a member ---------------------------------------------------------------------------------------
    def begin(self, gen: Generation) -> None:
        """This worker is a member of ``gen``: the heartbeat thread counts the registrations for the next one."""
        self._watch = gen.number

    def end(self) -> None:
        self._watch = None

    def joiners(self, gen: Generation) -> int:
        """Registrations for generation ``gen.number + 1`` as of the last heartbeat (returning workers, or
        members of ``gen`` that left it); 0 until the heartbeat thread has looked."""
        number, count = self._joiners
        return count if number == gen.number else 0
