"""The loopback roofline of ``torchstrategies bench allreduce``: raw TCP bytes, no reduction, no protocol.

Every rank sends ``2(n-1)/n * size`` bytes to its right neighbour (rank + 1) and receives as many from its
left neighbour (rank - 1) over plain TCP sockets on 127.0.0.1, all ranks at once, full duplex: exactly the
bytes one ring all-reduce of ``size`` bytes moves per rank and direction, in one stream, without the
reduction, the chunk steps or a descriptor check. With 2 ranks it is an exchange of ``size`` bytes each way
between ranks 0 and 1. Its time is what the sockets alone cost on this machine; an all-reduce over TCP
cannot beat it, so ``busbw(impl) / busbw(roofline)`` is the fraction of the loopback link an
implementation reaches (the busbw of the roofline is the bytes each rank sends per second).

One thread per rank drives both directions: non-blocking sockets, ``send``/``recv_into`` straight from and
into preallocated buffers (no copies in Python), ``poll`` only when neither direction can move, and
TCP_NODELAY. Socket buffers are left to the kernel's autotuning, which grows them up to
``net.ipv4.tcp_wmem``/``tcp_rmem``'s maximum (4 MiB / 32 MiB on a stock Linux); in an A/B under load, fixed
4 MiB buffers (the most ``net.core.wmem_max`` allows by default) were no faster at 1 MiB or 64 MiB, and
128 KiB ones were slower. ``TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES=N`` sets SO_SNDBUF/SO_RCVBUF to N
instead (before ``listen``/``connect``, so the window scales; the kernel caps N at ``wmem_max``/``rmem_max``).

It is a reference, not a proven upper bound: a C++ engine that sends and receives on separate threads or
several sockets may beat one Python thread, especially for large messages. Every listener is bound
to 127.0.0.1 (never a wildcard) on a port the kernel picks; addresses and a random per-run token go through
the c10d store, and a connection that does not present the token in its first 16 bytes is closed.

Example:
    >>> ring = LoopbackRing(store, rank, world, timeout=60.0)        # doctest: +SKIP
    >>> ring.exchange(send_view, recv_view)                          # doctest: +SKIP
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["LoopbackRing", "ring_bytes", "socket_buffer_bytes", "HOST", "BUFFER_ENV"]

HOST = "127.0.0.1"
BUFFER_ENV = "TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES"
_TOKEN_BYTES = 16
_KEY = "torchstrategies/bench/loopback"


def ring_bytes(size: int, world: int) -> int:
    """Bytes one ring all-reduce of ``size`` bytes sends (and receives) per rank: ``2(n-1)/n * size``."""
    if world < 2:
        return 0
    return 2 * (world - 1) * size // world


def socket_buffer_bytes() -> int:
    """SO_SNDBUF/SO_RCVBUF from TORCHSTRATEGIES_BENCH_SOCKET_BUFFER_BYTES; 0 (unset) = kernel autotuning.

    Raises:
        ValueError: the variable is not a whole number >= 0.
    """
    text = os.environ.get(BUFFER_ENV, "0").strip() or "0"
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{BUFFER_ENV} must be a whole number of bytes >= 0, got {text!r}")
    return n


def _tune(s: socket.socket, nbytes: int) -> None:
    if nbytes:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


class LoopbackRing:
    """A TCP connection to the right neighbour and one from the left neighbour, made through ``store``.

    Args:
        store: the process group's c10d store (``dist.distributed_c10d._get_default_store()``).
        rank: this rank (0..world-1).
        world: number of ranks (at least 2).
        timeout: seconds any wait (connect, accept, one exchange) may take before TimeoutError.

    Raises:
        ValueError: world below 2 or rank outside it.
        TimeoutError: the right neighbour could not be reached, or no connection with this run's token
            came from the left one, within ``timeout``.
    """

    def __init__(self, store: Store, rank: int, world: int, timeout: float = 300.0) -> None:
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"LoopbackRing needs world >= 2 and 0 <= rank < world, got rank {rank}, world {world}")
        self.rank, self.world, self.timeout = rank, world, timeout
        self.left, self.right = (rank - 1) % world, (rank + 1) % world
        self.buffer_bytes = buf = socket_buffer_bytes()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            _tune(listener, buf)  # accepted sockets inherit the buffer sizes; RCVBUF must precede listen()
            listener.bind((HOST, 0))
            listener.listen(1)
            listener.settimeout(timeout)
            token = secrets.token_bytes(_TOKEN_BYTES)
            store.set(f"{_KEY}/{rank}", f"{HOST}:{listener.getsockname()[1]}:{token.hex()}")
            host, port, right_token = store.get(f"{_KEY}/{self.right}").decode().split(":")
            _tune(self.out, buf)
            self.out.settimeout(timeout)
            self.out.connect((host, int(port)))
            self.out.sendall(bytes.fromhex(right_token))
            self.inp = self._accept(listener, token)
        except BaseException:
            self.out.close()
            raise
        finally:
            listener.close()
        for s in (self.out, self.inp):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self.out, 0)
        self._poll.register(self.inp, 0)

    def _accept(self, listener: socket.socket, token: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        while True:  # a stray local connection without the token is dropped, the left neighbour's kept
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                raise TimeoutError(f"loopback roofline: rank {self.left} did not connect to rank {self.rank} "
                                   f"within {self.timeout:g} s") from None
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            got = b""
            try:
                while len(got) < _TOKEN_BYTES:
                    chunk = conn.recv(_TOKEN_BYTES - len(got))
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                got = b""
            if secrets.compare_digest(got, token):
                return conn
            conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"loopback roofline: rank {self.rank} got no connection with this run's token from rank "
                    f"{self.left} within {self.timeout:g} s")

    def exchange(self, send: memoryview, recv: memoryview) -> None:
        """Sends all of ``send`` to the right neighbour while receiving ``len(recv)`` bytes from the left.

        Raises:
            ValueError: the views differ in length (every rank must move the same bytes).
            ConnectionError: a neighbour closed its connection.
            TimeoutError: the exchange took longer than ``timeout`` seconds.
        """
        n = len(send)
        if len(recv) != n:
            raise ValueError(f"send and recv must have the same length, got {n} and {len(recv)}")
        sent = got = 0
        deadline = None
        out, inp = self.out, self.inp
        while sent < n or got < n:
            moved = False
            if sent < n:
                try:
                    sent += out.send(send[sent:])
                    moved = True
                except BlockingIOError:
                    pass
            if got < n:
                try:
                    k = inp.recv_into(recv[got:], n - got)
                except BlockingIOError:
                    k = -1
                if k == 0:
                    raise ConnectionError(f"loopback roofline: rank {self.left} closed its connection to rank "
                                          f"{self.rank} after {got} of {n} bytes")
                if k > 0:
                    got += k
                    moved = True
            if moved:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            elif now > deadline:
                raise TimeoutError(f"loopback roofline: rank {self.rank} sent {sent} and received {got} of {n} "
                                   f"bytes within {self.timeout:g} s (ranks {self.left} / {self.right})")
            self._poll.modify(out, select.POLLOUT if sent < n else 0)
            self._poll.modify(inp, select.POLLIN if got < n else 0)
            self._poll.poll(min(1000, max(1, int((deadline - now) * 1000))))

    def close(self) -> None:
        for s in (self.out, self.inp):
            s.close()
