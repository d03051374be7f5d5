"""Simulated hosts on real links: one network namespace per host, a veth per host into a switch, ``tc tbf``.

:class:`Network` makes, for one run, ``N`` namespaces ``tsnet-<pid>-h<i>`` (the hosts) and one
``tsnet-<pid>-sw`` (the switch). Host ``i`` has one interface, :data:`IFACE`, with the address
``10.213.0.<i+1>/24``; its other end, ``p<i>``, sits in the switch namespace. Both ends get a ``tbf``
qdisc at the link's rate, so each host has a full-duplex link of that rate into the switch, as a NIC into a
switch port. The switch is a Linux bridge, or, with ``delay_ms > 0``, :mod:`~torchstrategies.bench.delay_hub`
(a userspace forwarder that holds every frame for the delay; this kernel has no ``netem``). Every veth is made
directly inside the namespaces, so nothing is ever added to the machine's own namespace, and deleting the
namespaces deletes every link.

Cleanup: :meth:`Network.close` (also on ``with`` exit) kills every process left in the namespaces and
deletes them, and a stop signal that arrives while it runs waits until it is done; :func:`handle_signals`
turns SIGINT/SIGTERM/SIGHUP into an exception so the ``finally`` runs, and ignores the ones after it, so a
second Ctrl-C cannot cut the cleanup short; processes started by :meth:`Network.popen` die with their parent
(``PR_SET_PDEATHSIG``); and :func:`sweep_stale` (run when a Network is made) removes namespaces of runs whose
process is gone.

Example (as root):
    >>> with handle_signals(), Network(hosts=2, rate_bits=10**9) as net:      # doctest: +SKIP
    ...     p = net.popen(0, ["python", "-c", "print(1)"], env={})
    ...     p.wait(); net.counters(0)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Network", "NetworkUnavailable", "available", "parse_rate", "sweep_stale", "handle_signals",
           "namespaces_of", "IFACE", "PREFIX", "SUBNET", "STOP_SIGNALS"]

PREFIX = "tsnet-"
IFACE = "tslink"
SUBNET = "10.213.0"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?(/s)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``, no veth or tbf); the message says which."""


def parse_rate(rate: str | int) -> int:
    """A link rate in bits per second: an int, or tc's spelling ("1gbit", "10Gbit", "500mbit", "1gbit/s";
    bare "bit" units; "Bps" means bytes).

    >>> parse_rate("1gbit"), parse_rate("10Gbit/s"), parse_rate("500mbit"), parse_rate(125)
    (1000000000, 10000000000, 500000000, 125)

    Raises:
        ValueError: not a positive rate (names the value).
    """
    if isinstance(rate, int) and not isinstance(rate, bool):
        bits = rate
    else:
        m = _RATE.match(str(rate))
        if not m:
            raise ValueError(f"link rate {rate!r} is not a rate like 1gbit, 10gbit or 500mbit")
        unit = m.group(3) or "bit"
        bits = int(float(m.group(1)) * _UNITS[m.group(2).lower()] * (8 if unit == "Bps" else 1))
    if bits <= 0:
        raise ValueError(f"link rate {rate!r} must be positive")
    return bits


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=60)


def available() -> str | None:
    """None if this process can make namespaces with veth links and tbf; else why not, in one sentence."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return f"making network namespaces needs root (this process runs as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2 is needed to make namespaces and links)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        made = _ip("-n", probe, "link", "add", "tsprobe0", "type", "veth", "peer", "name", "tsprobe1", check=False)
        if made.returncode:
            return f"cannot make a veth pair: {made.stderr.strip()}"
        tbf = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "tsprobe0", "root", "tbf",
                              "rate", "1gbit", "burst", "128kb", "limit", "1mb"], capture_output=True, text=True)
        if tbf.returncode:
            return f"no tbf qdisc in this kernel: {tbf.stderr.strip()}"
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        err = getattr(exc, "stderr", "") or exc
        return f"cannot make a network namespace: {str(err).strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def namespaces_of(pid: int | None = None) -> list[str]:
    """The namespaces named with our prefix (of the run of ``pid`` if given)."""
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    want = PREFIX if pid is None else f"{PREFIX}{pid}-"
    return [n for n in names if n.startswith(want)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(names: Sequence[str]) -> None:
    """Kills every process inside the namespaces, then deletes them (their veths go with them)."""
    for ns in names:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for p in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGKILL)
    for ns in names:
        for _ in range(50):  # a process being killed may hold the namespace a moment longer; the name goes now
            if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in namespaces_of():
                break
            time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Deletes the namespaces of earlier runs whose process is gone (names carry the run's pid); returns them."""
    stale = []
    for ns in namespaces_of():
        m = re.match(rf"^{re.escape(PREFIX)}(\d+)-", ns)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            stale.append(ns)
    _remove(stale)
    return stale


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """While inside, each of :data:`STOP_SIGNALS` stops the bench: SIGINT raises KeyboardInterrupt, SIGTERM and
    SIGHUP raise SystemExit(128 + signal), so the ``finally`` blocks that delete the namespaces run. That holds
    whatever the process inherited: a shell starts a background job (``cmd &`` in a script) with SIGINT
    ignored, and the namespaces outlive the bench unless it stops. The first one is enough: the ones after it
    are ignored until the block is left, so pressing Ctrl-C again cannot interrupt the cleanup.

    The stop is also remembered, and the block ends with it whatever else happens inside: Python prints and
    drops an exception raised where it cannot propagate (a signal that lands in a fork hook, e.g. logging's
    while ``subprocess`` forks, or in a ``__del__``), and the bench would then go on, or fail with whatever
    the stopped ranks' exit caused instead of saying it was stopped."""
    stopped: list[int] = []

    def stopping(signum: int) -> BaseException:
        return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)

    def stop(signum: int, _frame: Any) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        stopped.append(signum)
        raise stopping(signum)

    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    except BaseException as e:
        if stopped and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise stopping(stopped[0]) from e
        raise
    finally:
        _restore(old)
    if stopped:  # its exception was dropped on the way, and nothing failed after it
        raise stopping(stopped[0])


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Stop signals that arrive inside are raised again when it is left, so the cleanup inside runs to its end
    (in the main thread, where Python runs signal handlers; elsewhere it does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        _restore(old)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)  # now the handler that was there decides (raise, ignore, or the default)


def _restore(handlers: dict[signal.Signals, Any]) -> None:
    for s, h in handlers.items():
        signal.signal(s, signal.SIG_DFL if h is None else h)  # None: a handler not installed from Python


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the bench process dies (kept across exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Network:
    """N hosts (namespaces) on links of ``rate_bits`` into one switch; see the module docstring.

    Args:
        hosts: how many hosts (1 to 16).
        rate_bits: each link's rate, bits per second, per direction.
        delay_ms: one-way delay each frame gets in the switch (0: a Linux bridge, no added delay).

    Raises:
        NetworkUnavailable: namespaces cannot be made here (the message says why).
    """

    def __init__(self, hosts: int, rate_bits: int, delay_ms: float = 0.0) -> None:
        if not 1 <= hosts <= 16:
            raise ValueError(f"hosts must be between 1 and 16, got {hosts}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        why = available()
        if why:
            raise NetworkUnavailable(why)
        self.hosts, self.rate_bits, self.delay_ms = hosts, rate_bits, delay_ms
        self.run_prefix = f"{PREFIX}{os.getpid()}-"
        self.switch = self.run_prefix + "sw"
        self.names = [f"{self.run_prefix}h{i}" for i in range(hosts)]
        self._procs: list[subprocess.Popen[str]] = []
        self.swept = sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def _tbf(self, ns: str, dev: str) -> None:
        rate_bytes = self.rate_bits / 8
        # burst: 1 ms at the rate (>= 64 KiB, so a GSO packet passes whole); queue: 20 ms (>= 1 MiB) so TCP's
        # window, not tail drops, sets the pace
        burst = max(64 << 10, int(rate_bytes / 1000))
        limit = max(1 << 20, int(rate_bytes / 50))
        _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
            "burst", str(burst), "limit", str(limit))

    def _build(self) -> None:
        for ns in [self.switch, *self.names]:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if not self.delay_ms:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
            if not self.delay_ms:
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", self.switch, "link", "set", port, "up")
            self._tbf(ns, IFACE)
            self._tbf(self.switch, port)
        if self.delay_ms:
            hub = [sys.executable, "-m", "torchstrategies.bench.delay_hub", "--delay-ms", str(self.delay_ms),
                   *[f"p{i}" for i in range(self.hosts)]]
            proc = self.popen_in(self.switch, hub, env=_python_env(), stdout=subprocess.PIPE)
            assert proc.stdout is not None
            ready = proc.stdout.readline()  # the hub prints "ready" once its sockets are bound
            if ready.strip() != "ready":
                raise NetworkUnavailable(f"the delay hub did not start (exit {proc.poll()}): {ready!r}")

    def popen_in(self, ns: str, cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, text=True,
                                preexec_fn=_die_with_parent, **kw)
        self._procs.append(proc)
        return proc

    def popen(self, host: int, cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
        """Starts ``cmd`` inside host ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return self.popen_in(self.names[host], cmd, env, **kw)

    def counters(self, host: int) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of host ``host``'s link, as its veth counts them (frames, headers included)."""
        out = _ip("-n", self.names[host], "-s", "-j", "link", "show", "dev", IFACE).stdout
        import json

        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def close(self) -> None:
        """Kills what runs in the namespaces and deletes them (idempotent); a stop signal that arrives meanwhile
        is raised once they are gone."""
        with _signals_deferred():
            self._close()

    def _close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        mine = {self.switch, *self.names}
        _remove([ns for ns in namespaces_of(os.getpid()) if ns in mine])

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _python_env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, *sys.path]))
