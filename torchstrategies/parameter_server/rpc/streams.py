"""Long-lived gRPC streams that carry one request and its reply at a time (the hot path of the transport).

A step of a scheduled function makes three calls (the chief's Exec on a worker, the worker's Pull and Push on
each ps it touches). As separate unary calls, each pays gRPC's per-call set-up on both sides: a new HTTP/2
stream, its metadata, the authentication interceptor, a hand-off to a server thread, the status. On a stream
that stays open, a request is just one message each way; the stream was authenticated once, when it was
opened (with a single-use credential, see ``session.py``), before the server read any of its messages, and
each message carries its own single-use MAC.

* :class:`StreamPool` keeps a client's idle streams; a call takes one (or opens one), sends its request and
  waits for the reply, then gives the stream back. Concurrent calls use different streams, so the
  one-request-at-a-time rule holds per stream.
* A stream has no deadline of its own (it lives as long as the channel). Each request has one: the
  :class:`Watchdog` cancels a stream whose reply is late (or whose ``abort`` event is set), which ends the
  wait at once; the stream is then dropped, never reused.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

__all__ = ["Abort", "StreamPool", "StreamExpired", "StreamError", "Watchdog", "open_stream", "WATCHDOG_TICK"]

WATCHDOG_TICK = 0.05  # seconds between deadline checks: the slack of a per-request deadline
_END = object()
log = logging.getLogger("torchstrategies.parameter_server")


class Abort(Protocol):
    """What a call checks to be abandoned (a ``threading.Event``, or anything with ``is_set()``)."""

    def is_set(self) -> bool: ...


class StreamExpired(Exception):
    """The watchdog cancelled the stream: ``why`` is "deadline" (no reply in time) or "abort"."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class StreamError(grpc.RpcError):
    """A stream ended with a status other than OK (or the server ended it: UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stream:
    """What :class:`StreamPool` needs of a stream."""

    expired: str | None = None  # "deadline" or "abort" once the watchdog cancelled it

    def exchange(self, request: bytes) -> bytes:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _QueueStream(_Stream):
    """A stream on gRPC's public API: a gRPC thread feeds it requests from a queue, replies arrive through
    the channel's thread (two thread hand-offs per message on this side). The fallback of :class:`_OwnThreadStream`."""

    def __init__(self, channel: grpc.Channel, path: str, metadata: tuple[tuple[str, str], ...]):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = channel.stream_stream(path)(iter(self._requests.get, _END), metadata=metadata)

    def exchange(self, request: bytes) -> bytes:
        self._requests.put(request)
        try:
            return next(self._call)
        except StopIteration:
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the server ended the stream") from None

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(_END)  # ends gRPC's thread that reads the queue
        self._call.cancel()


class _OwnThreadStream(_Stream):
    """A stream driven entirely by the calling thread (as gRPC's own blocking unary calls are): each request
    is one batch (send the request, receive the reply) on the call's private completion queue, which the
    caller polls itself. No extra thread, no hand-off. Built on grpcio's Cython layer (the API its
    ``SingleThreadedUnaryStream`` option uses); :func:`open_stream` falls back to :class:`_QueueStream`
    where that layer differs."""

    def __init__(self, channel: grpc.Channel, path: str, metadata: tuple[tuple[str, str], ...]):
        from grpc._cython import cygrpc

        self._cygrpc = cygrpc
        ops = (
            ((cygrpc.SendInitialMetadataOperation(metadata, 0),), "metadata"),
            ((cygrpc.ReceiveInitialMetadataOperation(0),), "initial"),
            ((cygrpc.ReceiveStatusOnClientOperation(0),), "status"),
        )
        args = (cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, path.encode(), None, None, metadata, None,
                ops, cygrpc.build_census_context())
        raw = channel._channel  # type: ignore[attr-defined]
        try:
            self._call = raw.segregated_call(*args, None)  # grpcio >= 1.63: a registered-call handle
        except TypeError:
            self._call = raw.segregated_call(*args)
        self._pending = {"metadata", "initial", "status"}  # batches not yet completed
        self._status: StreamError | None = None
        self._receive = cygrpc.OperationType.receive_message
        self._status_type = cygrpc.OperationType.receive_status_on_client

    def _next(self) -> Any:
        event = self._call.next_event()
        self._pending.discard(event.tag)
        if event.tag == "status":
            for op in event.batch_operations:
                if op.type() == self._status_type:
                    code = _CODES.get(op.code(), grpc.StatusCode.UNKNOWN)
                    self._status = StreamError(
                        grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code,
                        op.details() or "the server ended the stream",
                    )
        return event

    def exchange(self, request: bytes) -> bytes:
        cygrpc = self._cygrpc
        if self._status is not None:
            raise self._status
        if not self._call.operate(
            (cygrpc.SendMessageOperation(request, 0), cygrpc.ReceiveMessageOperation(0)), "message"
        ):
            self._pending.clear()  # the call is over: nothing left to wait for
            raise StreamError(grpc.StatusCode.UNAVAILABLE, "the stream is closed")
        self._pending.add("message")
        while True:
            event = self._next()
            if event.tag != "message":
                continue
            reply = None
            if event.success:
                for op in event.batch_operations:
                    if op.type() == self._receive:
                        reply = op.message()
            if reply is not None:
                return reply
            self.close()  # the stream failed or ended: collect its status
            raise self._status or StreamError(grpc.StatusCode.UNAVAILABLE, "the stream ended")

    def cancel(self) -> None:
        self._call.cancel(self._cygrpc.StatusCode.cancelled, "cancelled by the client")

    def close(self) -> None:
        """Cancels the call and waits for its batches to complete (they do at once once it is cancelled), so
        that gRPC frees the call and its queue. Only the thread that uses the stream may call this."""
        if self._pending:
            self.cancel()
        while self._pending:
            self._next()


# grpcio's Cython layer is not its public API: the own-thread streams are a switch the user turns on
# (TORCHSTRATEGIES_PS_STREAM=own-thread, docs/parameter_server.md), never a default.
_use_own_thread = os.environ.get("TORCHSTRATEGIES_PS_STREAM", "queue") == "own-thread"


def open_stream(channel: grpc.Channel, path: str, metadata: tuple[tuple[str, str], ...]) -> _Stream:
    """A new stream of method ``path``: :class:`_QueueStream` (gRPC's public API), or with
    ``TORCHSTRATEGIES_PS_STREAM=own-thread`` :class:`_OwnThreadStream` where grpcio's internals allow."""
    global _use_own_thread
    if _use_own_thread:
        try:
            return _OwnThreadStream(channel, path, metadata)
        except (AttributeError, TypeError, ImportError) as exc:
            log.info("gRPC streams on the public API (%s: %s)", type(exc).__name__, exc)
            _use_own_thread = False
    return _QueueStream(channel, path, metadata)


class Watchdog:
    """Cancels streams whose reply is overdue or whose ``abort`` event was set (one thread per process,
    checking every :data:`WATCHDOG_TICK` seconds). The thread runs while a :class:`StreamPool` is open:
    the first pool starts it, closing the last one stops and joins it, so nothing of it outlives the
    channels at interpreter exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[_Stream, float | None, Abort | None]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._holders = 0

    def hold(self) -> None:
        """A pool opened: the thread runs from now on."""
        with self._lock:
            self._holders += 1
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="ps-stream-watchdog",
                                                daemon=True)
                self._thread.start()

    def release(self) -> None:
        """A pool closed: the last one stops the thread and waits for it."""
        with self._lock:
            self._holders -= 1
            if self._holders > 0 or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not threading.current_thread():
            thread.join()

    def watch(self, stream: _Stream, timeout: float | None, abort: Abort | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            token = next(self._ids)
            self._watched[token] = (stream, deadline, abort)
        return token

    def unwatch(self, token: int) -> None:
        with self._lock:
            self._watched.pop(token, None)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(WATCHDOG_TICK):
            now = time.monotonic()
            with self._lock:  # marked under the lock: a stream unwatched after this is never reused
                due = []
                for token, (stream, deadline, abort) in list(self._watched.items()):
                    if abort is not None and abort.is_set():
                        stream.expired = "abort"
                    elif deadline is not None and now >= deadline:
                        stream.expired = "deadline"
                    else:
                        continue
                    del self._watched[token]
                    due.append(stream)
            for stream in due:
                stream.cancel()


_watchdog = Watchdog()


class StreamPool:
    """A client's open streams to one peer, one per concurrent caller (idle ones are reused)."""

    def __init__(self, channel: grpc.Channel, metadata: Callable[[str], tuple[tuple[str, str], ...]]):
        self._channel = channel
        self._metadata = metadata  # path -> the metadata that opens a stream of it (a fresh credential)
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Stream]] = {}
        self._busy: set[_Stream] = set()
        self._closed = False
        _watchdog.hold()

    def exchange(self, path: str, request: bytes, timeout: float | None, abort: Abort | None) -> bytes:
        """Sends ``request`` on an idle stream of method ``path`` (or a new one) and returns its reply.

        Raises:
            StreamExpired: no reply within ``timeout`` seconds, or ``abort`` was set (the stream is
                cancelled: the server sees the call end).
            grpc.RpcError: the stream failed (the peer is gone or stopping).
            ValueError: the pool (or its channel) is closed.
        """
        with self._lock:
            if self._closed:
                raise ValueError("the stream pool is closed")
            idle = self._idle.get(path)
            stream = idle.pop() if idle else open_stream(self._channel, path, self._metadata(path))
            self._busy.add(stream)
        watched = timeout is not None or abort is not None
        token = _watchdog.watch(stream, timeout, abort) if watched else -1
        ok = False
        try:
            reply = stream.exchange(request)
            ok = True
            return reply
        except grpc.RpcError:
            if stream.expired is not None:
                raise StreamExpired(stream.expired) from None
            raise
        finally:
            if watched:
                _watchdog.unwatch(token)
            self._give_back(path, stream, ok and stream.expired is None)

    def _give_back(self, path: str, stream: _Stream, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(stream)
            if reusable and not self._closed:
                self._idle.setdefault(path, []).append(stream)
                return
        stream.close()

    def close(self) -> None:
        """Closes every stream; a call waiting on one fails at once (and closes its stream itself)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [st for streams in self._idle.values() for st in streams]
            busy = list(self._busy)
            self._idle.clear()
        for st in busy:
            st.cancel()
        for st in idle:
            st.close()
        _watchdog.release()
