"""Heartbeats through the rendezvous store, so a failed collective can name the rank that died or hung.

Every rank runs a daemon thread that writes ``<prefix>/<rank> = "<beat> <collective seq>"`` every
``interval`` seconds. When a collective fails or times out, :meth:`HealthMonitor.diagnose` first keeps an
error the ``"torchstrategies"`` backend already named (``collectives.from_backend_error``: it knows the
ranks, from its own transport); for any other (gloo, NCCL) it reads every rank's beat twice, ``grace``
seconds apart: a rank whose beat did not advance is dead or frozen; a rank that is alive but whose
collective sequence number is behind ours had not arrived at the collective.

Bound: each read of the beats waits at most ``store_seconds`` (2 s) for the store, so a frozen store host
(rank 0 when it hosts the store) cannot hang the error path: diagnose returns within
``2 * store_seconds + grace`` (5.5 s with the defaults), after the collective's own timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from torchstrategies.collectives import from_backend_error
from torchstrategies.collectives._common import STORE_SECONDS, bounded_store_call, says_timeout
from torchstrategies.errors import DeadlineExceededError, UnavailableError

__all__ = ["HealthMonitor"]

log = logging.getLogger("torchstrategies.multi_worker")


class HealthMonitor:
    """Heartbeat writer and post-mortem reader for one rank."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, prefix: str = "torchstrategies/mwms/hb",
                 interval: float = 0.25, store_seconds: float = STORE_SECONDS):
        self.store = store
        self.store_seconds = store_seconds  # bound on each read of the beats on the error path
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.interval = interval
        self.seq = 0  # collectives started by this rank (set by the strategy)
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and world_size > 1:
            self._write()
            self._thread = threading.Thread(target=self._loop, name="torchstrategies-heartbeat", daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _the_store(self) -> dist.Store:
        if self.store is None:
            raise RuntimeError("this rank has no rendezvous store")
        return self.store

    def _write(self) -> None:
        self._beat += 1
        self._the_store().set(self._key(self.rank), f"{self._beat} {self.seq}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - the store went away; diagnose() reports it
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None

    def _read_all(self) -> dict[int, tuple[int, int]]:
        """Every other rank's (beat, seq); (-1, -1) if it never wrote one. TimeoutError: the store did not
        answer within ``store_seconds`` (its host is frozen)."""

        def read() -> dict[int, tuple[int, int]]:
            store = self._the_store()
            out = {}
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = self._key(r)
                if not store.check([key]):
                    out[r] = (-1, -1)
                    continue
                beat, seq = store.get(key).decode().split()
                out[r] = (int(beat), int(seq))
            return out

        return bounded_store_call(read, self.store_seconds)

    def suspects(self, grace: float | None = None) -> tuple[list[int], list[int]]:
        """(ranks whose heartbeat stopped, live ranks behind our collective sequence number)."""
        grace = 4 * self.interval + 0.5 if grace is None else grace
        first = self._read_all()
        time.sleep(grace)
        second = self._read_all()
        dead = sorted(r for r in second if second[r][0] == first[r][0])
        behind = sorted(r for r in second if r not in dead and second[r][1] < self.seq)
        return dead, behind

    def diagnose(self, exc: BaseException, what: str) -> Exception:
        """Turns a failed collective's exception into the named error to raise.

        An error of the ``"torchstrategies"`` backend is already named (``collectives.from_backend_error``)
        and returned as such; any other becomes UnavailableError / DeadlineExceededError naming the ranks
        whose heartbeat stopped or that had not arrived. Returns within ``2 * store_seconds + grace``.
        """
        named = from_backend_error(exc)
        if named is not exc and isinstance(named, Exception):
            return named
        text = str(exc)
        timed_out = says_timeout(text)
        try:
            dead, behind = self.suspects()
        except TimeoutError as store_exc:
            return DeadlineExceededError(
                f"{what} failed on rank {self.rank} and the rendezvous store does not answer ({store_exc}): "
                f"the process hosting it (rank 0 unless torchrun's agent hosts it) is frozen. Cause: {text}"
            )
        except Exception as store_exc:  # noqa: BLE001
            return UnavailableError(
                f"{what} failed on rank {self.rank} and the rendezvous store is unreachable ({store_exc}); "
                f"the process hosting it (rank 0 unless torchrun's agent hosts it) is gone. Cause: {text}"
            )
        if dead:
            cls = DeadlineExceededError if timed_out else UnavailableError
            return cls(
                f"{what} failed on rank {self.rank}: rank(s) {dead} stopped answering (no heartbeat for "
                f"{4 * self.interval + 0.5:.1f}s; dead or hung). Cause: {text}"
            )
        if behind:
            return DeadlineExceededError(
                f"{what} did not complete on rank {self.rank}: rank(s) {behind} had not arrived at collective "
                f"#{self.seq}. Cause: {text}"
            )
        cls = DeadlineExceededError if timed_out else UnavailableError
        return cls(f"{what} failed on rank {self.rank}: {text}")
