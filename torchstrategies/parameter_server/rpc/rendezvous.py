"""The rendezvous: each ps and worker task publishes where it listens in a TCPStore, signed and fresh.

An entry ``<prefix>/addr/<kind>/<index>`` holds ``host:port|instance|seq`` signed with the job secret
(HMAC-SHA256 over the key and the value, see ``auth.py``): ``instance`` is a random id the task's server
draws when it starts (the server proves it in every handshake, see ``session.py``), ``seq`` the value of
the counter ``<prefix>/seq/<kind>/<index>`` that the task incremented just before writing the entry. The
chief (:class:`EntryReader`) refuses an entry whose signature does not match (someone else wrote it) or
that is older than the task's counter or than an entry it has already read for that task (a replayed
entry, e.g. the one a task wrote before it restarted).

The store itself is not authenticated: torch's TCPStore accepts every connection. Whoever reaches it can
delete or overwrite entries (the job then fails to find a task: a denial of service, reported by name), but
cannot make the chief connect to an address no task of this job published now.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass

from torchstrategies.errors import UnavailableError
from torchstrategies.parameter_server.rpc.auth import JobAuth

__all__ = ["Entry", "EntryReader", "publish", "entry_key", "connect_store", "local_address", "store_prefix"]

log = logging.getLogger("torchstrategies.parameter_server")


def local_address(master_addr: str) -> str:
    """The address of this host as seen from ``master_addr`` (127.0.0.1 for a local master)."""
    override = os.environ.get("TORCHSTRATEGIES_PS_HOST")
    if override:
        return override
    if master_addr in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def store_prefix() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"torchstrategies/ps/{run}/{restart}"


def entry_key(kind: str, index: int) -> str:
    return f"{store_prefix()}/addr/{kind}/{index}"


def _seq_key(kind: str, index: int) -> str:
    return f"{store_prefix()}/seq/{kind}/{index}"


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` only (TCPStore's own server would listen on every interface)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(info[0], socket.SOCK_STREAM)
    s.bind(info[4])
    s.listen(512)
    return s


def connect_store(host: str, port: int, is_chief: bool, world_size: int, timeout: float):
    """The rendezvous store: torchrun's agent store if there is one (it listens on every interface: see
    docs/parameter_server.md, "What to firewall"), else one the chief hosts on ``host`` only."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if is_chief and not agent:
        try:
            sock = _listen(host, port)
        except OSError as exc:  # port taken: somebody else hosts it
            log.info("chief could not host the store on %s:%s (%s); connecting as a client", host, port, exc)
        else:
            try:
                return dist.TCPStore(
                    host, port, world_size, True, td, wait_for_workers=False, master_listen_fd=sock.detach()
                )  # the store owns the fd from here
            except (RuntimeError, OSError) as exc:
                log.info(
                    "chief could not host the store on %s:%s (%s); connecting as a client", host, port, exc
                )
    try:
        return dist.TCPStore(host, port, world_size, False, td)
    except (RuntimeError, OSError) as exc:
        raise UnavailableError(
            f"cannot reach the rendezvous store at {host}:{port} within {timeout:.0f}s: {exc}"
        ) from None


@dataclass(frozen=True)
class Entry:
    """A task's published address, its server's instance id and the entry's sequence number."""

    address: str
    instance: str
    seq: int


def publish(store, auth: JobAuth, kind: str, index: int, address: str, instance: str) -> Entry:
    """Writes this task's entry, newer than any it wrote before."""
    seq = int(store.add(_seq_key(kind, index), 1))
    key = entry_key(kind, index)
    store.set(key, auth.sign(key, f"{address}|{instance}|{seq}"))
    return Entry(address, instance, seq)


class EntryReader:
    """The chief's reader of entries: checks each one's signature and freshness (thread-safe)."""

    def __init__(self, store, auth: JobAuth):
        self._store = store
        self._auth = auth
        self._newest: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def read(self, kind: str, index: int) -> Entry:
        """The current entry of task ``kind:index``.

        Raises:
            UnavailableError: the entry is not signed with this job's secret, is malformed, or is older
                than one already read or than the task's counter (a replayed entry).
        """
        key = entry_key(kind, index)
        try:
            value = self._auth.verify(key, self._store.get(key).decode())
        except ValueError as exc:
            raise UnavailableError(f"{kind}:{index}: {exc}") from None
        parts = value.split("|")
        if len(parts) != 3 or not parts[2].isdigit():
            raise UnavailableError(f"{kind}:{index}: malformed rendezvous entry {value[:80]!r}")
        address, instance, seq = parts[0], parts[1], int(parts[2])
        counter = int(self._store.add(_seq_key(kind, index), 0))
        with self._lock:
            newest = max(counter, self._newest.get((kind, index), 0))
            if seq < newest:
                raise UnavailableError(
                    f"{kind}:{index}: the rendezvous entry {key!r} is stale (sequence {seq}, but the task has "
                    f"published entry {newest} since): a replayed older entry is refused"
                )
            self._newest[(kind, index)] = seq
        return Entry(address, instance, seq)
