"""The torch.distributed backend ``"torchstrategies"``: registered on ``import torchstrategies``.

Every rank, under torchrun::

    import torch.distributed as dist
    import torchstrategies  # registers the backend
    dist.init_process_group("torchstrategies")                    # or "cpu:torchstrategies,cuda:nccl"
    g = dist.new_group([0, 1], backend="torchstrategies",
                       pg_options=torchstrategies.collectives.BackendOptions(implementation="RING", timeout=30))

The C++ side is ``csrc/cpu/backend.*`` on ``csrc/core/transport.*``; this module is its creator: it reads the
options and the environment, makes the gloo group that serves the collectives we hand over (send/recv,
all_to_all, gather, scatter, reduce), and calls ``_C.make_backend``.

Environment (read when a group is made; the settings marked * must be the same on every rank, which the
set-up checks, naming the variable, on every rank):

* ``TORCHSTRATEGIES_IMPLEMENTATION`` *: AUTO (default), SHM, RING or HIERARCHICAL for groups made without
  ``BackendOptions`` (``init_process_group("torchstrategies")`` under torchrun).
* ``TORCHSTRATEGIES_HOST_ID``: this rank's host identity (default: the hostname); tests simulate hosts with it.
* ``TORCHSTRATEGIES_RING_ADDR``: the address the ring listens on (default: the source address of the route
  to ``MASTER_ADDR``; never a wildcard).
* ``TORCHSTRATEGIES_SHM_SLOT_BYTES`` * (1 MiB), ``TORCHSTRATEGIES_RING_SMALL_BYTES`` * (64 KiB),
  ``TORCHSTRATEGIES_RING_CHUNK_BYTES`` * (256 KiB), ``TORCHSTRATEGIES_DEBUG`` *;
  per rank: ``TORCHSTRATEGIES_RING_SOCKET_BYTES``, ``TORCHSTRATEGIES_RING_THREAD_BYTES``,
  ``TORCHSTRATEGIES_SHM_SPIN_US`` (docs/collectives.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from torchstrategies._ext import _C
from torchstrategies.collectives import topology
from torchstrategies.collectives._common import from_backend_error
from torchstrategies.collectives.options import CommunicationImplementation as Impl

_log = logging.getLogger("torchstrategies.collectives")

__all__ = ["BACKEND", "BackendOptions", "register", "bind_address", "IMPLEMENTATIONS", "shm_slot_bytes",
           "gloo_backend"]

BACKEND = "torchstrategies"
# The implementations the backend runs (GLOO and NCCL are torch's own backends; TREE was removed).
IMPLEMENTATIONS = (Impl.AUTO, Impl.SHM, Impl.RING, Impl.HIERARCHICAL)
_CODES = {Impl.AUTO: 0, Impl.SHM: 1, Impl.RING: 2, Impl.HIERARCHICAL: 3}
# Each rank's shared-memory staging slot (x2, double buffered), i.e. the chunk a large all-reduce moves per
# round: small enough that a chunk's slices stay in a core's L2 between the copy in, the reduction and the
# copy out (was 4 MiB; the comparison to re-measure is in docs/collectives.md, Benchmark).
SHM_SLOT_BYTES = 1 << 20


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be non-negative")
    return value


def _implementation(value: Impl | str) -> Impl:
    impl = Impl.from_any(value)
    if impl not in IMPLEMENTATIONS:
        if impl is Impl.TREE:
            raise ValueError("implementation TREE was removed: it lost to gloo's own all-reduce at every size "
                             "(docs/collectives.md); use AUTO, RING or GLOO")
        raise ValueError(f"the torchstrategies backend runs {', '.join(i.name for i in IMPLEMENTATIONS)}; "
                         f"{impl.name} is torch's own backend ({impl.name.lower()!r})")
    return impl


class BackendOptions:
    """Options of a process group on the ``"torchstrategies"`` backend (``pg_options=`` of ``dist.new_group``
    or ``dist.init_process_group``).

    Args:
        implementation: AUTO, SHM, RING or HIERARCHICAL (a ``CommunicationImplementation`` or its name).
            None: ``TORCHSTRATEGIES_IMPLEMENTATION``, else AUTO. AUTO: every rank on one host -> SHM; several
            hosts, some with more than one rank -> HIERARCHICAL; else RING.
        timeout: seconds (or a ``timedelta``) every collective of the group may take; None: the timeout given
            to ``new_group`` / ``init_process_group``.

    Example:
        >>> from torchstrategies.collectives import BackendOptions
        >>> BackendOptions(implementation="ring", timeout=30)
        BackendOptions(implementation=RING, timeout=30.0)
    """

    def __init__(self, implementation: Impl | str | None = None,
                 timeout: float | datetime.timedelta | None = None) -> None:
        self.implementation = None if implementation is None else _implementation(implementation)
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        self.timeout = None if timeout is None else float(timeout)

    def __repr__(self) -> str:
        impl = None if self.implementation is None else self.implementation.name
        return f"BackendOptions(implementation={impl}, timeout={self.timeout})"


def bind_address() -> str:
    """This rank's numeric address for the ring to listen on: TORCHSTRATEGIES_RING_ADDR, else the source
    address of the route to MASTER_ADDR (loopback if the master is local), else the hostname's address."""
    named = os.environ.get("TORCHSTRATEGIES_RING_ADDR")
    if named:
        try:
            return str(socket.getaddrinfo(named, None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            raise ValueError(f"TORCHSTRATEGIES_RING_ADDR={named!r} does not resolve: {exc}") from exc
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            fam, _, _, _, sa = socket.getaddrinfo(master, None, type=socket.SOCK_DGRAM)[0]
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect((sa[0], int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def _create(dist_opts: c10d._DistributedBackendOptions, pg_options: object) -> c10d.Backend:
    """The creator torch calls for every group on this backend (``extended_api=True``)."""
    if pg_options is not None and not isinstance(pg_options, BackendOptions):
        raise TypeError(f"pg_options of a torchstrategies group must be torchstrategies.collectives."
                        f"BackendOptions, got {type(pg_options).__name__}")
    opts = pg_options if pg_options is not None else BackendOptions()
    impl = opts.implementation or _implementation(os.environ.get("TORCHSTRATEGIES_IMPLEMENTATION") or "AUTO")
    timeout = opts.timeout if opts.timeout is not None else dist_opts.timeout.total_seconds()
    rank, size = dist_opts.group_rank, dist_opts.group_size
    ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    name = "world" if not dist_opts.global_ranks_in_group else f"group '{dist_opts.group_id}'"
    return make(dist_opts.store, rank, size, timeout, ranks, f"{name} (global ranks {ranks})", impl)


def shm_slot_bytes() -> int:
    """The staging-slot size in bytes: ``TORCHSTRATEGIES_SHM_SLOT_BYTES``, else :data:`SHM_SLOT_BYTES`."""
    return _int_env("TORCHSTRATEGIES_SHM_SLOT_BYTES", SHM_SLOT_BYTES)


def make(store: dist.Store, rank: int, size: int, timeout: float, global_ranks: list[int], desc: str,
         impl: Impl, setup_timeout: float | None = None) -> c10d.Backend:
    """A torchstrategies c10d backend on ``store`` (collective over the group's ranks). Every backend is made
    here, whoever asks (``init_process_group`` / ``new_group`` through :func:`_create`, or the collectives
    API for a group on another backend), so this is where the one INFO record saying which implementation
    it runs is logged (docs/logging.md).

    ``timeout`` is the group's (its calls' default); ``setup_timeout`` (None: ``timeout``) bounds the set-up
    here: the collectives API passes the timeout of the call that makes the backend, so a first call with a
    short timeout and a missing peer raises within that timeout, not the group's."""
    setup = timeout if setup_timeout is None else setup_timeout
    slot = shm_slot_bytes()
    small = _int_env("TORCHSTRATEGIES_RING_SMALL_BYTES", 64 << 10)
    chunk = _int_env("TORCHSTRATEGIES_RING_CHUNK_BYTES", 256 << 10)
    settings = [
        ("implementation", impl.name),
        ("TORCHSTRATEGIES_DEBUG", os.environ.get("TORCHSTRATEGIES_DEBUG", "")),
        ("TORCHSTRATEGIES_SHM_SLOT_BYTES", str(slot)),
        ("TORCHSTRATEGIES_RING_SMALL_BYTES", str(small)),
        ("TORCHSTRATEGIES_RING_CHUNK_BYTES", str(chunk)),
    ]
    try:
        made = _C.make_backend(
            store, rank, size, timeout, setup, global_ranks, desc, _CODES[impl], topology.host_id(),
            bind_address() if impl is not Impl.SHM else "", slot, small, chunk,
            _int_env("TORCHSTRATEGIES_RING_SOCKET_BYTES", 0), settings)
    except dist.DistBackendError as exc:
        raise from_backend_error(exc) from None
    # gloo connects every pair now (send/recv need it ready); our own set-up has already succeeded.
    gloo = gloo_backend(dist.PrefixStore("gloo/", store), rank, size, timeout, setup)
    _C.backend_set_gloo(made, gloo)
    _log.info("implementation %s (asked %s) for %d ranks of %s", _C.backend_plan(made)[0], impl.name, size, desc)
    return made


def gloo_backend(store: dist.Store, rank: int, size: int, timeout: float, setup_timeout: float) -> c10d.Backend:
    """A gloo backend whose connecting (collective, in the constructor) waits at most ``setup_timeout``
    seconds and whose calls default to ``timeout``."""
    gloo = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=setup_timeout))
    if setup_timeout != timeout:
        gloo.set_timeout(datetime.timedelta(seconds=timeout))
    return gloo


def register() -> None:
    """Registers the backend with torch.distributed (idempotent; ``import torchstrategies`` does it)."""
    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
