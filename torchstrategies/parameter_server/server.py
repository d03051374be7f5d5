"""``Server``: what the ps and worker tasks run (``ts.distribute.Server(cluster_resolver).join()``).

A server binds a gRPC port on its own task's address (the host of its entry in the cluster spec, or this
host's address towards the rendezvous for torchrun's placeholders; never a wildcard unless
``TORCHSTRATEGIES_PS_HOST`` asks for one), draws a random instance id, publishes ``host:port``, the id and
a sequence number in the rendezvous store signed with the job secret (``rendezvous.py``), and answers the
chief (and, on a ps, the workers) until the chief shuts the cluster down; in every handshake it proves that
it holds the secret and is this instance of its task (``session.py``). The
chief holds a Watch stream to every server and sends a heartbeat every second; a server whose Watch stream
ends without a shutdown (the chief exited, crashed, or stopped answering keepalive pings) or that hears no
heartbeat for ``lease_timeout`` seconds stops serving and ``join()`` raises
:class:`~torchstrategies.errors.UnavailableError`, so no server outlives its chief.

Example (the same script runs on every task; torchrun ranks: 0 chief, 1..num_ps ps, the rest workers)::

    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type in ("ps", "worker"):
        ts.distribute.Server(resolver).join()      # returns when the chief is done
    else:
        strategy = ts.ParameterServerStrategy(resolver)
        ...
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

from torchstrategies.cluster_resolver import ClusterResolver
from torchstrategies.errors import UnavailableError
from torchstrategies.parameter_server.ps_service import ParameterStore
from torchstrategies.parameter_server.rpc.auth import CHIEF, JobAuth
from torchstrategies.parameter_server.rpc.rendezvous import connect_store, local_address, publish
from torchstrategies.parameter_server.rpc.transport import RpcServer
from torchstrategies.parameter_server.worker_runtime import WorkerRuntime

__all__ = ["Server"]

log = logging.getLogger("torchstrategies.parameter_server")

DEFAULT_TIMEOUT = 60.0
DEFAULT_LEASE = 30.0


class Server:
    """A ps or worker task of a ParameterServerStrategy cluster (``tf.distribute.Server``).

    Args:
        cluster_resolver: says which task this process is (``task_type`` "ps" or "worker") and where the
            chief's rendezvous store is (``master_addr``/``master_port``).
        timeout: seconds to reach the rendezvous store and to wait for the chief's first contact.
        lease_timeout: seconds without a heartbeat from the chief after which the server gives up.
        start: start serving at once (TF's ``start=True``); otherwise call :meth:`start`.

    Raises:
        ValueError: the resolver's task is not a "ps" or "worker", or the job has no credentials (see
            :mod:`~torchstrategies.parameter_server.rpc.auth`).

    Example:
        >>> resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)   # doctest: +SKIP
        >>> ts.distribute.Server(resolver).join()                                 # doctest: +SKIP
    """

    def __init__(self, cluster_resolver, *, timeout: float = DEFAULT_TIMEOUT,
                 lease_timeout: float = DEFAULT_LEASE, start: bool = True):
        task_type = cluster_resolver.task_type
        if task_type not in ("ps", "worker"):
            raise ValueError(
                f"Server runs the 'ps' and 'worker' tasks; this process is {task_type!r}:{cluster_resolver.task_id}."
                " The chief creates ParameterServerStrategy(cluster_resolver) instead."
            )
        self.cluster_resolver = cluster_resolver
        self.task_type: str = task_type
        self.task_id: int = int(cluster_resolver.task_id)
        self.timeout = float(timeout)
        self.lease_timeout = float(lease_timeout)
        self._done = threading.Event()
        self._shutdown_requested = False
        self._chief_lost: str | None = None
        self._last_contact = time.monotonic()
        self._chief_seen = False
        self._stopping = False
        self._lock = threading.Lock()
        self._rpc: RpcServer | None = None
        self.auth = JobAuth.from_env()
        self.params: ParameterStore | None = None     # a ps task's shards and optimizers
        self._runtime: WorkerRuntime | None = None    # a worker task's closures
        if task_type == "ps":
            self.params = ParameterStore()
        else:
            self._runtime = WorkerRuntime(self)
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``host:port`` this server listens on (TF's ``Server.target``, without a protocol)."""
        if self._rpc is None:
            raise RuntimeError("the server is not started")
        return f"{self._address}:{self._rpc.port}"

    def start(self) -> None:
        """Binds the port and publishes it in the rendezvous store."""
        if self._rpc is not None:
            return
        r = self.cluster_resolver
        self._address = _bind_host(r, self.task_type, self.task_id)
        self.instance = secrets.token_hex(16)
        services = ("ParameterServer", "Control") if self.task_type == "ps" else ("Worker", "Control")
        self._rpc = RpcServer(self._handle, services, self._address, self.auth,
                              f"{self.task_type}:{self.task_id}|{self.instance}", on_watch_end=self._on_watch_end)
        store = connect_store(r.master_addr, r.master_port, False, r.world_size, self.timeout)
        publish(store, self.auth, self.task_type, self.task_id, self.target, self.instance)
        del store          # only the chief reads the store after this; no connection is left to outlive it
        self._last_contact = time.monotonic()
        log.info("%s:%d serving at %s", self.task_type, self.task_id, self.target)

    def join(self) -> None:
        """Serves until the chief shuts the cluster down.

        Raises:
            UnavailableError: the chief went away (exited, crashed, or silent for ``lease_timeout`` seconds)
                without shutting the cluster down.
        """
        self.start()
        try:
            while not self._done.wait(0.25):
                silent = time.monotonic() - self._last_contact
                limit = self.lease_timeout if self._chief_seen else max(self.lease_timeout, self.timeout)
                if silent > limit:
                    self._lose_chief(f"no message from the chief for {silent:.1f}s (lease {limit:.1f}s)")
        finally:
            self.stop()
        if self._chief_lost is not None and not self._shutdown_requested:
            raise UnavailableError(f"{self.task_type}:{self.task_id}: the chief is gone: {self._chief_lost}")

    def stop(self) -> None:
        """Stops serving (closes every connection); ``join()`` then returns."""
        self._stopping = True
        self._done.set()
        if self._rpc is not None:
            self._rpc.close()
        if self._runtime is not None:
            self._runtime.close()

    # ---- request handling ----------------------------------------------------------------------
    def _handle(self, role: str, op: str, header: dict, tensors, encode):
        """Runs one authenticated call (the transport already checked ``role`` may call ``op``)."""
        if role == CHIEF:
            self._chief_seen = True
            self._last_contact = time.monotonic()
        if op == "hello":
            return {"task": f"{self.task_type}:{self.task_id}"}, []
        if op == "heartbeat":
            return {}, []
        if op == "shutdown":
            self._shutdown_requested = True
            self._done.set()
            return {}, []
        if self.params is not None:
            return self.params.handle(header, tensors, encode)
        if self._runtime is not None:
            return self._runtime.handle(header, tensors)
        raise ValueError(f"{self.task_type}:{self.task_id}: unknown request {op!r}")

    def _on_watch_end(self, role: str) -> None:
        """Runs on a gRPC thread when a Watch stream ends: must not block."""
        if role == CHIEF and not self._shutdown_requested:
            self._lose_chief("the chief's Watch stream ended (the chief exited, crashed or stopped "
                             "answering)")

    def _lose_chief(self, why: str) -> None:
        if self._shutdown_requested or self._stopping or self._chief_lost is not None:
            return
        self._chief_lost = why
        log.warning("%s:%d stops: %s", self.task_type, self.task_id, why)
        self._done.set()


def _bind_host(resolver: ClusterResolver, task_type: str, task_id: int) -> str:
    """The host this task's server binds: its cluster-spec entry, else its address towards the rendezvous."""
    override = os.environ.get("TORCHSTRATEGIES_PS_HOST")
    if override:
        return override
    try:
        address = resolver.cluster_spec().task_address(task_type, task_id)
    except Exception:  # noqa: BLE001 - no usable spec entry
        address = ""
    host, sep, _port = str(address).rpartition(":")
    host = host.strip("[]")
    if sep and host and host != "rank":
        return host
    return local_address(resolver.master_addr)
