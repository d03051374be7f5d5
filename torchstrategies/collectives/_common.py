"""The one place every collective error is built (a gone peer is UnavailableError, a late one
DeadlineExceededError, ranks making different calls ValueError): from the torchstrategies backend's messages,
and for gloo / NCCL groups from bounded waits on their work; plus the dtype and op tables.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from torchstrategies._ext import _C
from torchstrategies.collectives import topology
from torchstrategies.collectives.group_state import GroupState
from torchstrategies.errors import DeadlineExceededError, UnavailableError
from torchstrategies.ops import DTYPE_CODES, FLOAT_DTYPES, SUPPORTED_DTYPES  # the one dtype table (from C++)
from torchstrategies.reduce_op import ReduceOp

__all__ = ["from_backend_error", "wait_work", "deadline_error", "peer_error", "FLOAT_DTYPES",
           "SUPPORTED_DTYPES", "DTYPE_CODES", "OP_CODES", "report_fault", "reported_fault", "diagnose",
           "remember_peers", "host_hash", "bounded_store_call", "STORE_SECONDS", "says_timeout"]

T = TypeVar("T")

# The reduce-op codes every SHM communicator call takes and call descriptors compare: exported from C++.
OP_CODES: dict[ReduceOp, int] = {op: int(_C.REDUCE_OP_CODES[op.name]) for op in ReduceOp}

# Words in gloo's / c10d's messages that mean "the peer did not answer in time" (else: it is gone).
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline")


_BACKEND_ERRORS: dict[str, type[Exception]] = {
    "DeadlineExceededError": DeadlineExceededError,
    "UnavailableError": UnavailableError,
    "ValueError": ValueError,
}


def from_backend_error(exc: BaseException) -> BaseException:
    """The documented error for one the torchstrategies backend raised (torch.distributed.DistBackendError
    whose message starts with ``"torchstrategies <Name>: "``); anything else is returned as it is."""
    text = str(exc)
    start = text.find("torchstrategies ")
    if start >= 0:
        name, _, rest = text[start + len("torchstrategies "):].partition(": ")
        kind = _BACKEND_ERRORS.get(name)
        if kind is not None:
            return kind(rest.strip())
    return exc


def deadline_error(what: str, group_desc: str, timeout: float, missing: list[int] | None, cause: object) -> Exception:
    """A peer is late: DeadlineExceededError naming the ranks that did not arrive."""
    who = f"ranks {missing} did not arrive" if missing else "not all ranks arrived"
    return DeadlineExceededError(f"{what} on {group_desc}: {who} within {timeout:g} s ({cause})")


def peer_error(what: str, group_desc: str, gone: list[int] | None, cause: object) -> Exception:
    """A peer is gone (process died, connection closed): UnavailableError naming it."""
    who = f"ranks {gone} are gone" if gone else "a peer is gone"
    return UnavailableError(f"{what} on {group_desc}: {who} ({cause})")


def says_timeout(text: str) -> bool:
    """Whether an error message from gloo / c10d means "the peer did not answer in time"."""
    text = text.lower()
    return any(w in text for w in _TIMEOUT_WORDS)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or says_timeout(str(exc))


def host_hash() -> int:
    """A stable 31-bit hash of the machine's hostname (not TORCHSTRATEGIES_HOST_ID: pids are checked on the
    real machine, which simulated hosts share)."""
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def remember_peers(group: dist.ProcessGroup, peers: list[tuple[int, int]]) -> None:
    """Records (host hash, pid) per group rank of ``group`` (from a successful exchange), so that a later
    failure can be pinned on the rank that is really gone (or stopped) among those on this host."""
    GroupState.of(group).peers = peers


def _proc_state(pid: int) -> str:
    """'gone', 'stopped' or 'running' for a pid on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "running"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "running"
    return "gone" if state in ("Z", "X") else "stopped" if state in ("T", "t") else "running"


def diagnose(group: dist.ProcessGroup) -> tuple[list[int], list[int]]:
    """(gone, stopped) global ranks of ``group`` among those on this host, from their pids."""
    info = GroupState.of(group).peers
    if info is None:
        return [], []
    ranks = topology.group_ranks(group)
    me, host = os.getpid(), host_hash()
    gone, stopped = [], []
    for r, (h, pid) in zip(ranks, info):
        if h != host or pid == me or pid <= 0:
            continue
        state = _proc_state(pid)
        if state == "gone":
            gone.append(r)
        elif state == "stopped":
            stopped.append(r)
    return gone, stopped


def wait_work(work: dist.Work, timeout: float, what: str, group_desc: str, peers: list[int],
              group: dist.ProcessGroup | None = None) -> None:
    """Waits for a c10d Work with a bound; a timeout names ``peers`` as late, a broken connection as gone.

    When ``group`` is given, the rank that is really at fault is named: a rank on this host whose process
    is gone (UnavailableError) or stopped (DeadlineExceededError), else the rank another rank reported
    gone in the store (``report_fault``), else ``peers``.
    """
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo reports timeouts and dead peers as RuntimeError
        cause = f"{type(exc).__name__}: {exc}"
        if group is not None:
            gone, stopped = diagnose(group)
            timed_out = _is_timeout(exc)
            for _ in range(10 if not (gone or timed_out) else 0):
                # A closed connection can be seen while the peer is still exiting: look again briefly.
                time.sleep(0.05)
                gone, stopped = diagnose(group)
                if gone:
                    break
            if gone:
                report_fault(group, gone[0])
                raise peer_error(what, group_desc, gone, f"process gone; {cause}") from exc
            if stopped and _is_timeout(exc):
                raise deadline_error(what, group_desc, timeout, stopped, f"process stopped; {cause}") from exc
            seen = reported_fault(group)
            if seen is not None and seen[0] not in peers:
                err = peer_error(what, group_desc, [seen[0]],
                                 f"rank {seen[1]} reported it gone; this rank waited on ranks {peers}: {cause}")
                raise err from exc
        if _is_timeout(exc):
            err = deadline_error(what, group_desc, timeout, peers, cause)
        else:
            err = peer_error(what, group_desc, peers, cause)
            if group is not None and len(peers) == 1:
                report_fault(group, peers[0])
        raise err from exc
    if ok is False:
        raise deadline_error(what, group_desc, timeout, peers, "wait returned False")


STORE_SECONDS = 2.0  # bound on one store call on an error path (a frozen store host must not hang it)


def bounded_store_call(call: Callable[[], T], seconds: float = STORE_SECONDS) -> T:
    """Runs a store call on a daemon thread and waits at most ``seconds`` for it.

    Returns its result, re-raises its exception, or raises TimeoutError when it did not answer in time (a
    frozen store host: the connection stays open and nothing comes back; the thread is left behind, blocked).
    """
    box: list[T] = []
    failed: list[Exception] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            failed.append(exc)

    t = threading.Thread(target=run, daemon=True, name="torchstrategies-store")
    t.start()
    t.join(seconds)
    if failed:
        raise failed[0]
    if not box:
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:g} s")
    return box[0]


def _bounded(call: Callable[[], T], seconds: float = STORE_SECONDS) -> T | None:
    """A bounded store call whose failure or silence means "unknown": its result, else None."""
    try:
        return bounded_store_call(call, seconds)
    except Exception:  # noqa: BLE001 - an unanswered or failed store call is "unknown"
        return None


def _fault_key(group: dist.ProcessGroup) -> str:
    return "torchstrategies/fault/" + "-".join(map(str, topology.group_ranks(group)))


def report_fault(group: dist.ProcessGroup, gone: int) -> None:
    """Records in the c10d store that global rank ``gone`` left ``group`` (best effort)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = _fault_key(group)
    except Exception:  # noqa: BLE001 - the store may be gone too; the error itself is raised anyway
        return
    _bounded(lambda: store.set(key, f"{gone}:{dist.get_rank()}"))


def reported_fault(group: dist.ProcessGroup) -> tuple[int, int] | None:
    """(gone rank, reporting rank) if a rank of ``group`` reported a gone peer, else None."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = _fault_key(group)
    except Exception:  # noqa: BLE001
        return None
    if not _bounded(lambda: store.check([key])):
        return None
    raw = _bounded(lambda: store.get(key))
    if raw is None:
        return None
    try:
        gone, by = raw.decode().split(":")
        return int(gone), int(by)
    except Exception:  # noqa: BLE001 - no answer, or not ours
        return None
