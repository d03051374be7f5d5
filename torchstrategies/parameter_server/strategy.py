"""``ParameterServerStrategy``: asynchronous data-parallel training with parameters on ps tasks.

Runs on the chief. The ps and worker tasks run :class:`~torchstrategies.distribute.Server`. Parameters of
modules created under :meth:`ParameterServerStrategy.scope` (and the state of optimizers over them) live on
the ps tasks, round-robin, split into row shards when a ``variable_partitioner`` asks for it. Training is
driven by a :class:`~torchstrategies.coordinator.ClusterCoordinator`: scheduled functions run on the workers,
which pull parameters, compute gradients and push them; the ps apply them with the optimizer as they arrive.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import threading
import time
import weakref
from typing import Protocol

import torch

from torchstrategies.distribute.distribute_lib import Strategy
from torchstrategies.errors import DeadlineExceededError, UnavailableError
from torchstrategies.parameter_server.base import ParameterServerExtended
from torchstrategies.parameter_server.registry import Registry
from torchstrategies.parameter_server.rpc.auth import CHIEF, JobAuth
from torchstrategies.parameter_server.rpc.client import RpcClient
from torchstrategies.parameter_server.rpc.rendezvous import Entry, EntryReader, connect_store, entry_key
from torchstrategies.parameter_server.rpc.transport import RemoteError
from torchstrategies.parameter_server.worker_links import WorkerInstance, WorkerLink

__all__ = ["ParameterServerStrategy"]

log = logging.getLogger("torchstrategies.parameter_server")


class CoordinatorHooks(Protocol):
    """What the strategy tells its :class:`~torchstrategies.coordinator.ClusterCoordinator` (which registers
    itself as ``strategy._cluster_coordinator``): the strategy never imports the coordinator it serves.
    A worker's death needs no hook: the coordinator follows the worker's :class:`WorkerLink`."""

    def _ps_failed(self, message: str) -> None: ...

    def _stop(self, limit: float) -> None: ...

    def _close_clients(self) -> None: ...


class ParameterServerStrategy(Strategy):
    """Asynchronous training with parameters on parameter servers (``tf.distribute.ParameterServerStrategy``).

    Create it on the chief; the ps and worker tasks run ``Server(cluster_resolver).join()``.

    Args:
        cluster_resolver: a resolver whose cluster has a ``chief``, ``ps`` and ``worker`` jobs and whose task
            is the chief (e.g. ``TorchrunClusterResolver(num_ps=1)`` on rank 0, or ``TFConfigClusterResolver``).
        variable_partitioner: optional callable ``(shape, dtype) -> [k, 1, ...]`` (see
            :mod:`torchstrategies.partitioners`); parameters it splits become ``k`` contiguous row shards on the
            ps tasks round-robin.
        max_staleness: optional bound (stale-synchronous parallel): a worker does not start a new scheduled
            function while it has completed more than ``max_staleness`` functions more than the slowest live
            worker. ``None`` (default): fully asynchronous.
        timeout: seconds allowed to reach every task at start-up, for any ps request, and for the cluster
            to have no live worker before ``join`` gives up; a dead ps is reported within it.
        heartbeat_interval: seconds between the chief's heartbeats to every task.
        heartbeat_timeout: seconds a task has to answer a heartbeat (default ``min(timeout, 10)``). The
            heartbeats to different tasks run in parallel, each with its own deadline, so a task that died
            or froze (SIGSTOP) is found within ``heartbeat_interval + heartbeat_timeout`` seconds whatever
            the others do: a worker's in-flight closure is then re-queued on another worker, a ps makes
            ``schedule``/``join``/``done`` raise :class:`UnavailableError` naming it.

    Raises:
        ValueError: the resolver's task is not the chief, the cluster has no ps or no worker, or the job has
            no credentials (``TORCHSTRATEGIES_PS_SECRET`` or mutual TLS; see docs/parameter_server.md).
        UnavailableError: a task did not come up within ``timeout``.

    Example:
        >>> resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)    # doctest: +SKIP
        >>> strategy = ts.ParameterServerStrategy(resolver)                       # doctest: +SKIP
        >>> with strategy.scope():                                                # doctest: +SKIP
        ...     model = torch.nn.Linear(4, 2)
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> coordinator = ts.coordinator.ClusterCoordinator(strategy)             # doctest: +SKIP
    """

    def __init__(self, cluster_resolver, variable_partitioner=None, *, max_staleness: int | None = None,
                 timeout: float = 60.0, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float | None = None):
        self._check_arguments(cluster_resolver, variable_partitioner, max_staleness)
        self._cluster_resolver = cluster_resolver
        self._variable_partitioner = variable_partitioner
        self._max_staleness = max_staleness
        self._timeout = float(timeout)
        self._heartbeat_interval = float(heartbeat_interval)
        self._heartbeat_timeout = float(min(self._timeout, 10.0) if heartbeat_timeout is None
                                        else heartbeat_timeout)
        if self._heartbeat_timeout <= 0 or self._heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval and heartbeat_timeout must be > 0, got "
                             f"{heartbeat_interval!r} and {heartbeat_timeout!r}")
        self._auth = JobAuth.from_env()
        self._hb_inflight: set[RpcClient] = set()
        self._replacing: dict[int, threading.Thread] = {}
        self._stopping = threading.Event()
        self._hb_lock = threading.Lock()
        self._fatal: str | None = None
        self._closed = False
        self._cluster_coordinator: CoordinatorHooks | None = None
        self._store = connect_store(cluster_resolver.master_addr, cluster_resolver.master_port, True,
                                    cluster_resolver.world_size, self._timeout)
        self._entries = EntryReader(self._store, self._auth)
        self._wait_for_tasks()
        self._connect_tasks()
        self._registry = Registry(self, self._num_ps, self._ps_call, variable_partitioner)
        super().__init__(ParameterServerExtended(self))
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="ps-heartbeat", daemon=True)
        self._hb_thread.start()
        ref = weakref.ref(self)

        def shutdown_at_exit() -> None:
            strategy = ref()
            if strategy is not None:
                strategy.shutdown()

        atexit.register(shutdown_at_exit)

    def _check_arguments(self, cluster_resolver, variable_partitioner, max_staleness) -> None:
        """Sets the cluster's sizes; raises ValueError for a task that is not the chief or a bad argument."""
        spec = cluster_resolver.cluster_spec()
        if cluster_resolver.task_type != "chief":
            raise ValueError(
                f"ParameterServerStrategy is created on the chief; this process is "
                f"{cluster_resolver.task_type!r}:{cluster_resolver.task_id}. ps and worker tasks run "
                "ts.distribute.Server(cluster_resolver).join()"
            )
        self._num_ps = spec.num_tasks("ps")
        self._num_workers = spec.num_tasks("worker")
        if self._num_ps < 1 or self._num_workers < 1:
            raise ValueError(f"ParameterServerStrategy needs at least one 'ps' and one 'worker' task; the cluster "
                             f"has {self._num_ps} ps and {self._num_workers} workers: {spec!r}")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or a non-negative int, got {max_staleness!r}")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise ValueError(f"variable_partitioner must be callable (shape, dtype) -> list, got "
                             f"{variable_partitioner!r}")

    def _connect_tasks(self) -> None:
        """Opens a data and a control (watched) channel to every ps, a control channel to every worker (whose
        instance the worker's :class:`WorkerLink` then follows)."""
        self._ps_clients: list[RpcClient] = []
        self._ps_control: list[RpcClient] = []
        ps_instances = []
        for i in range(self._num_ps):
            address, instance = self._server_address("ps", i)
            self._ps_clients.append(self._hello(address, f"ps:{i}", instance))
            self._ps_control.append(self._hello(address, f"ps:{i}", instance, watch=True))
            ps_instances.append(instance)
        self._ps_addresses = [c.address for c in self._ps_clients]
        self._ps_entries = [[a, i] for a, i in zip(self._ps_addresses, ps_instances, strict=True)]
        self._workers: list[WorkerLink] = []
        for i in range(self._num_workers):
            entry = self._entries.read("worker", i)
            first = WorkerInstance(i, entry.address, entry.instance, self._open_worker_control(i, entry))
            self._workers.append(WorkerLink(first, self._read_worker_entry, self._reconnect_worker_control))

    @property
    def variable_partitioner(self):
        return self._variable_partitioner

    def shutdown(self) -> None:
        """Stops the coordinator and tells every ps and worker task to exit (also run at interpreter exit).

        In order: the heartbeats stop, the coordinator's threads stop (their calls in flight are abandoned),
        every task is told to exit, then every channel is closed; each thread is joined, so nothing of the
        strategy runs on into interpreter exit. A thread still connecting to a task that does not answer is
        waited for at most one ``heartbeat_timeout`` (or 5 s for the coordinator's), then left behind.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._extended._release_torch_patches()
        limit = min(5.0, self._timeout)
        self._hb_thread.join()
        with self._hb_lock:
            reconnecting = list(self._replacing.values())
        for thread in reconnecting:
            thread.join(self._heartbeat_timeout)
        if self._cluster_coordinator is not None:
            self._cluster_coordinator._stop(limit)
        # In parallel, each with its own deadline: a frozen task delays shutdown by at most that deadline.
        pending = threading.Semaphore(0)
        clients = self._ps_control + [link.latest.control for link in self._workers]
        for client in clients:
            try:
                client.call_async({"op": "shutdown"}, limit, lambda _err: pending.release())
            except Exception:  # noqa: BLE001 - a task that is gone needs no shutdown
                pending.release()
        end = time.monotonic() + limit + 1.0
        for _ in clients:
            if not pending.acquire(timeout=max(0.0, end - time.monotonic())):
                break
        for client in clients:
            client.close()
        for c in self._ps_clients:
            c.close()
        if self._cluster_coordinator is not None:
            self._cluster_coordinator._close_clients()

    # ---- extensions used by tests, the bench and the docs --------------------------------------
    def parameter_locations(self, param: torch.Tensor) -> list[tuple[int, int, int]]:
        """Where a parameter lives: ``[(ps index, first row, one past the last row), ...]`` per shard."""
        vid = self._registry.param_vid.get(id(param))
        if vid is None:
            raise ValueError("this tensor is not a parameter placed by this strategy (create it under scope())")
        return [(sh.ps, sh.start, sh.stop) for sh in self._registry.specs[vid].shards]

    def ps_stats(self, ps: int) -> dict:
        """A ps task's counters: ``version`` (updates applied), ``pushes``, ``vars`` (shard key -> shape)."""
        reply, _ = self._ps_call(ps, {"op": "stats"}, [])
        out = {k: v for k, v in reply.items() if k != "ok"}
        out["vars"] = {k: tuple(v) for k, v in out.get("vars", {}).items()}
        return out

    # ---- internals -----------------------------------------------------------------------------
    def _wait_for_tasks(self) -> None:
        keys = [entry_key("ps", i) for i in range(self._num_ps)]
        keys += [entry_key("worker", i) for i in range(self._num_workers)]
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self._timeout))
        except Exception:  # noqa: BLE001 - find out which ones are missing
            missing = [k.rsplit("/", 2)[-2] + ":" + k.rsplit("/", 1)[-1] for k in keys if not self._store.check([k])]
            raise UnavailableError(
                f"tasks {missing} did not start within {self._timeout:.0f}s (every ps and worker task must run "
                "ts.distribute.Server(cluster_resolver).join())"
            ) from None

    def _server_address(self, kind: str, index: int) -> tuple[str, str]:
        """``(address, instance)`` of a task, from its signed rendezvous entry (refused if stale)."""
        entry = self._entries.read(kind, index)
        return entry.address, entry.instance

    def _read_worker_entry(self, index: int) -> Entry:
        return self._entries.read("worker", index)

    def _open_worker_control(self, index: int, entry: Entry) -> RpcClient:
        return self._hello(entry.address, f"worker:{index}", entry.instance, watch=True)

    def _reconnect_worker_control(self, index: int, entry: Entry) -> RpcClient:
        """A restarted worker's control channel: within one heartbeat deadline, so a task that published
        and died again holds up nothing for long."""
        return self._hello(entry.address, f"worker:{index}", entry.instance, watch=True,
                           timeout=self._heartbeat_timeout)

    def _hello(self, address: str, name: str, instance: str, watch: bool = False,
               timeout: float | None = None) -> RpcClient:
        client = RpcClient(address, name, timeout or self._timeout, self._auth, CHIEF, instance=instance,
                           hello={"op": "hello"})
        try:
            if watch:
                client.watch()
        except BaseException:
            client.close()
            raise
        return client

    def _connect_worker(self, index: int, address: str, instance: str) -> RpcClient:
        client = self._hello(address, f"worker:{index}", instance)
        try:
            client.call({"op": "setup", "ps": self._ps_entries, "worker_index": index,
                         "num_workers": self._num_workers, "timeout": self._timeout})
        except BaseException:
            client.close()
            raise
        return client

    def _ps_call(self, ps: int, header: dict, tensors):
        if self._fatal is not None:
            raise UnavailableError(self._fatal)
        try:
            return self._ps_clients[ps].call(header, tensors)
        except (UnavailableError, DeadlineExceededError) as exc:
            self._ps_failed(f"ps:{ps} is unavailable: {exc}")
            raise UnavailableError(self._fatal) from None
        except RemoteError as e:
            raise e.exc from None

    def _ps_failed(self, message: str) -> None:
        if self._fatal is None:
            self._fatal = message
            log.error("%s", message)
        if self._cluster_coordinator is not None:
            self._cluster_coordinator._ps_failed(self._fatal)

    def _heartbeat_loop(self) -> None:
        """Every ``heartbeat_interval``: one heartbeat per task, all in flight at once, each with its own
        deadline; a channel whose previous heartbeat is still unanswered gets no second one. A worker's
        heartbeat goes to its latest instance; when that one is dead, the worker's link looks (on a thread
        of its own) for the instance that replaced it."""
        while not self._closed:
            for i, client in enumerate(self._ps_control):
                self._beat(client, functools.partial(self._ps_heartbeat_failed, i))
            for link in self._workers:
                latest = link.latest
                if latest.dead.is_set():
                    self._find_worker_soon(link)
                else:
                    self._beat(latest.control, functools.partial(self._worker_heartbeat_failed, latest))
            self._stopping.wait(self._heartbeat_interval)

    def _beat(self, client: RpcClient, failed) -> None:
        with self._hb_lock:
            if self._closed or client in self._hb_inflight:
                return
            self._hb_inflight.add(client)

        def done(error: BaseException | None) -> None:
            with self._hb_lock:
                self._hb_inflight.discard(client)
            if error is not None and not self._closed:
                failed(error)

        try:
            client.call_async({"op": "heartbeat"}, self._heartbeat_timeout, done)
        except Exception as exc:  # noqa: BLE001 - e.g. the channel was closed meanwhile
            done(exc)

    def _ps_heartbeat_failed(self, i: int, error: BaseException) -> None:
        self._ps_failed(f"ps:{i} is unavailable: {error}")

    @staticmethod
    def _worker_heartbeat_failed(instance: WorkerInstance, error: BaseException) -> None:
        """That instance is dead or frozen: the coordinator abandons (and re-queues) the closure it runs there."""
        instance.mark_dead(f"stopped answering heartbeats ({error}); its closure is re-queued")

    def _find_worker_soon(self, link: WorkerLink) -> None:
        """Runs ``link.find_successor()`` on its own thread (the one path that looks for a lost worker), so
        connecting to a worker that came back never delays the heartbeats of the others."""
        def run() -> None:
            try:
                link.find_successor()
            finally:
                with self._hb_lock:
                    self._replacing.pop(link.index, None)

        with self._hb_lock:
            if self._closed or link.index in self._replacing:
                return
            thread = threading.Thread(target=run, name=f"ps-reconnect-{link.index}", daemon=True)
            self._replacing[link.index] = thread
            thread.start()
