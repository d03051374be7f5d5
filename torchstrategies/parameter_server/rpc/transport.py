"""The parameter server's transport: gRPC services between tasks, authenticated per connection.

Why gRPC, as TF's parameter server: each pair of tasks that talks (chief -> ps, chief -> worker,
worker -> ps) has its own channel (``grpc.use_local_subchannel_pool``: its own TCP connection), so one death
or freeze breaks only that task's channels; HTTP/2 keepalive notices a dead or frozen peer; every call has a
deadline; servers reject oversized messages before reading them (``max_receive_message_length``).

Services (``/torchstrategies.ps.v1.<Service>/<Method>``; each body is a :mod:`wire` message behind an
authentication frame (:mod:`session`), raw bytes through gRPC's generic handlers so nothing is parsed before
the authentication interceptor has accepted the call):

* ``Auth``: Handshake (the only method open without a credential; its body is never read);
* ``ParameterServer``: Create, Assign, AssignAdd, AssignSub, Pull, PullRows, Push (one request per ps per
  step, batching every shard the step touches), CreateOptimizer, SetHparams, Stats;
* ``Worker``: Setup, Exec (a closure, cloudpickled; only the chief may call it);
* ``Control``: Hello, Heartbeat, Shutdown, Watch (a long-lived stream that ends when the chief goes away).

A client first runs the handshake (:mod:`session`): the server proves it holds the job secret and is the
task instance the client expects, and both derive a session key that never crosses the network. Every later
call carries a single-use credential made with that key (checked by the interceptor, before gRPC reads the
body), and every request and reply message a single-use MAC over its header and blobs (checked before the
message is decoded).

``ParameterServer/Stream`` and ``Worker/Stream`` carry the same requests on long-lived bidirectional streams,
one request and its reply at a time (:mod:`streams`): this is what ``client.RpcClient`` uses for every
ParameterServer and Worker method, so a training step pays gRPC's per-call set-up only once per stream.
A stream is authenticated when it opens, by the same interceptor and before any of its messages is read;
each message names its method (``op``), which the server checks against the stream's service and the
caller's role (a chief-only method from a worker's stream is refused, its body never unpickled). Each
request still has its deadline: the client cancels a stream whose reply is late.

The client side (:class:`~torchstrategies.parameter_server.rpc.client.RpcClient`) is in ``client.py``.
Errors: a deadline becomes :class:`DeadlineExceededError`, any other transport failure
:class:`UnavailableError`, both naming the peer and the method; an exception raised by the handler comes
back as :class:`RemoteError` (rebuilt from its type name and message, never unpickled, except closure errors
from a worker to the chief, see ``coordinator.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import traceback
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import torch

from torchstrategies.errors import UnavailableError
from torchstrategies.parameter_server.rpc import wire
from torchstrategies.parameter_server.rpc.auth import AUTH_KEY, CHIEF, JobAuth
from torchstrategies.parameter_server.rpc.session import (
    FRAME,
    HELLO_KEY,
    AuthError,
    OpenSession,
    Session,
    SessionTable,
)

__all__ = ["RpcServer", "RemoteError", "max_message_bytes", "call_abandoned", "METHODS"]

log = logging.getLogger("torchstrategies.parameter_server")

_PKG = "torchstrategies.ps.v1"
METHODS: dict[str, tuple[str, str]] = {
    "create": ("ParameterServer", "Create"),
    "assign": ("ParameterServer", "Assign"),
    "assign_add": ("ParameterServer", "AssignAdd"),
    "assign_sub": ("ParameterServer", "AssignSub"),
    "pull": ("ParameterServer", "Pull"),
    "pull_rows": ("ParameterServer", "PullRows"),
    "push": ("ParameterServer", "Push"),
    "create_optimizer": ("ParameterServer", "CreateOptimizer"),
    "set_hparams": ("ParameterServer", "SetHparams"),
    "stats": ("ParameterServer", "Stats"),
    "setup": ("Worker", "Setup"),
    "exec": ("Worker", "Exec"),
    "hello": ("Control", "Hello"),
    "heartbeat": ("Control", "Heartbeat"),
    "shutdown": ("Control", "Shutdown"),
}
WATCH_PATH = f"/{_PKG}.Control/Watch"
HANDSHAKE_PATH = f"/{_PKG}.Auth/Handshake"
PATHS = {op: f"/{_PKG}.{svc}/{m}" for op, (svc, m) in METHODS.items()}
# The services whose methods also travel on a long-lived stream (``/<pkg>.<Service>/Stream``).
STREAM_SERVICES = ("ParameterServer", "Worker")
STREAM_PATHS = {svc: f"/{_PKG}.{svc}/Stream" for svc in STREAM_SERVICES}
# What only the chief may call: everything that unpickles (exec, setup, optimizers) or controls the task.
_CHIEF_ONLY = {
    PATHS[op]
    for op in ("create", "create_optimizer", "set_hparams", "stats", "setup", "exec", "heartbeat", "shutdown")
} | {WATCH_PATH, STREAM_PATHS["Worker"]}


_malloc_tuned = False


def tune_malloc() -> None:
    """With ``TORCHSTRATEGIES_PS_TUNE_MALLOC=1`` only: keeps freed large buffers in the heap instead of
    returning them to the kernel (glibc only).

    Every gRPC message of a few MB is copied through fresh buffers (the request bytes, gRPC's slices, the
    reply bytes); with glibc's defaults each is a new ``mmap`` whose pages fault in and are zeroed on first
    touch. Raising the mmap threshold to its maximum (32 MiB) and the trim threshold lets the heap reuse
    those pages. ``mallopt`` changes the whole process's allocator, not only this library's buffers, so it
    is a switch the user turns on (docs/parameter_server.md), never a default.
    """
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("TORCHSTRATEGIES_PS_TUNE_MALLOC", "0") != "1":
        return
    _malloc_tuned = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def max_message_bytes() -> int:
    """The largest message a task sends or accepts (``TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES``, 512 MiB)."""
    raw = os.environ.get("TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES", str(512 << 20))
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES must be an int, got {raw!r}") from None
    if not 1 << 10 <= n < 1 << 31:
        raise ValueError(f"TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES must be in [1 KiB, 2 GiB), got {n}")
    return n


def _keepalive_ms() -> int:
    return int(float(os.environ.get("TORCHSTRATEGIES_PS_KEEPALIVE_S", "10")) * 1000)


def channel_options(server: bool) -> list[tuple[str, Any]]:
    n = max_message_bytes()
    ka = _keepalive_ms()
    opts: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
        ("grpc.keepalive_time_ms", ka),
        ("grpc.keepalive_timeout_ms", max(1000, ka // 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        opts += [
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", max(500, ka // 2)),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", max(500, ka // 2)),
        ]
    else:
        opts += [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
    return opts


_current = threading.local()


def call_abandoned() -> bool:
    """Whether the caller of the request this thread is serving has cancelled it or gone away (a chief
    that declared this worker frozen and re-queued its closure elsewhere)."""
    context = getattr(_current, "context", None)
    return context is not None and not context.is_active()


class RemoteError(Exception):
    """Carries an exception raised by a handler on the other side of a call (``reply``: the error header)."""

    def __init__(self, exc: BaseException, text: str, reply: dict | None = None):
        super().__init__(text)
        self.exc = exc
        self.text = text
        self.reply = reply or {}


# ---- server --------------------------------------------------------------------------------------------
# handler(role, op, header, tensors, encode) -> (reply header, tensors), or (reply header, bytes) where the
# bytes come from ``encode(reply header, tensors)`` (a handler that must encode under its own lock).
Encode = Callable[[dict, list[torch.Tensor]], bytes]
Handler = Callable[[str, str, dict, list[torch.Tensor], Encode], tuple[dict, Any]]


def _deny(code: grpc.StatusCode, message: str):
    def behavior(request_iterator, context):  # never reads the request
        context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(behavior)


class _AuthInterceptor(grpc.ServerInterceptor):
    """Checks the call's credential (metadata only) before gRPC reads or parses the request, and hands the
    caller's session to the handler."""

    def __init__(self, sessions: SessionTable | None):
        self.sessions = sessions  # None: TLS without a secret, every peer is the chief
        self._open = OpenSession()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method == HANDSHAKE_PATH:
            return continuation(handler_call_details)
        session: Session | None = self._open
        if self.sessions is not None:
            credential = None
            for k, v in handler_call_details.invocation_metadata or ():
                if k == AUTH_KEY:
                    credential = v
            session = self.sessions.check_call(method, credential)
        if session is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing, wrong or replayed job credentials")
        if method in _CHIEF_ONLY and session.role != CHIEF:
            return _deny(grpc.StatusCode.PERMISSION_DENIED, f"{method} is for the chief only")
        handler = continuation(handler_call_details)
        if handler is None or not method.startswith(f"/{_PKG}."):
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(functools.partial(handler.unary_stream, session=session))
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                functools.partial(handler.stream_stream, session=session)
            )
        return grpc.unary_unary_rpc_method_handler(functools.partial(handler.unary_unary, session=session))


class RpcServer:
    """A gRPC server bound to ``host`` (never a wildcard unless asked) serving this task's methods.

    ``identity``: ``"<task>|<instance>"``, what this server proves in every handshake (the client checks it
    against the task's rendezvous entry). ``handler(role, op, header, tensors, encode) -> (reply, tensors)``;
    an exception is sent back in the reply. ``on_watch_end(role)`` runs when a Watch stream ends without the
    server stopping (the chief is gone). Each open stream (a client's Watch, or its Stream of requests) holds
    one of the ``max_workers`` threads while it is open; threads are started as needed.
    """

    def __init__(
        self,
        handler: Handler,
        services: tuple[str, ...],
        host: str,
        auth: JobAuth,
        identity: str,
        on_watch_end: Callable[[str], None] | None = None,
        max_workers: int = 1024,
    ):
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        tune_malloc()
        self._handler = handler
        self._on_watch_end = on_watch_end
        self._sessions = None if auth.secret is None else SessionTable(auth.secret, identity)
        self._stopping = threading.Event()
        self._streams: dict[Any, list[bool]] = {}  # open request streams -> [busy answering a request]
        self._streams_lock = threading.Lock()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ps-rpc"),
            interceptors=[_AuthInterceptor(self._sessions)],
            options=channel_options(True),
        )
        by_service: dict[str, dict[str, Any]] = {
            "Auth": {"Handshake": grpc.stream_unary_rpc_method_handler(self._handshake)}
        }
        for op, (svc, method) in METHODS.items():
            if svc in services:
                by_service.setdefault(svc, {})[method] = grpc.unary_unary_rpc_method_handler(
                    functools.partial(self._unary, op)
                )
        for svc in STREAM_SERVICES:
            if svc in services:
                by_service[svc]["Stream"] = grpc.stream_stream_rpc_method_handler(
                    functools.partial(self._stream, svc)
                )
        by_service.setdefault("Control", {})["Watch"] = grpc.unary_stream_rpc_method_handler(self._watch)
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(f"{_PKG}.{svc}", m) for svc, m in by_service.items()]
        )
        self._health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        port = (
            self._server.add_secure_port(bind, auth.server_credentials())
            if auth.tls
            else self._server.add_insecure_port(bind)
        )
        if not port:
            raise UnavailableError(f"cannot bind a parameter-server port on {host!r}")
        self.port = port
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)

    def _handshake(self, request_iterator, context) -> bytes:
        """Answers a client's hello (its metadata); never reads the request body."""
        if self._sessions is None:
            return b""  # TLS without a secret: the TLS handshake authenticated the client
        hello = None
        for k, v in context.invocation_metadata() or ():
            if k == HELLO_KEY:
                hello = v
        try:
            return self._sessions.handshake(hello)
        except AuthError as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # not reached: abort raises

    def _unary(self, op: str, request: bytes, context, session: Session) -> bytes:
        _current.context = context
        try:
            return self._answer(session, op, request, context)
        finally:
            _current.context = None

    def _stream(self, service: str, requests, context, session: Session):
        """Answers the requests of one stream in order, until the client closes it or the server stops."""
        busy = [False]
        with self._streams_lock:
            if self._stopping.is_set():
                return
            self._streams[context] = busy
        _current.context = context  # this thread serves only this stream while it is open
        try:
            while not self._stopping.is_set():
                try:
                    request = next(requests)
                except (StopIteration, grpc.RpcError):  # closed or cancelled by the client, or stopping
                    return
                busy[0] = True
                yield self._answer(session, None, request, context, service)
                busy[0] = False
        finally:
            _current.context = None
            with self._streams_lock:
                self._streams.pop(context, None)

    def _open(self, session: Session, request: bytes, context) -> tuple[int, int]:
        """The request's ``(seq, covered)``; a message that does not authenticate ends the call."""
        try:
            return session.open(request)
        except AuthError as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # not reached: abort raises

    def _answer(self, session: Session, op: str | None, request: bytes, context, service: str = "") -> bytes:
        """The reply to one request; ``op=None``: a stream's message, which names its own method."""
        seq, covered = self._open(session, request, context)
        seal = session.sealer(seq, reply=True)
        try:
            header, tensors = wire.decode(request, copy=False, offset=FRAME, covered=covered)  # read only
            if op is None:
                op = header.get("op")
                if not isinstance(op, str) or METHODS.get(op, ("",))[0] != service:
                    raise ValueError(f"{op!r} is not a method of the {service} service")
                if PATHS[op] in _CHIEF_ONLY and session.role != CHIEF:
                    raise PermissionError(f"{PATHS[op]} is for the chief only")
            elif header.get("op") != op:  # the MAC covers the header's op: a body moved to another method
                raise ValueError(f"a {header.get('op')!r} request arrived on the {op!r} method")

            def encode(reply: dict, out: list[torch.Tensor]) -> bytes:
                return wire.encode({"ok": True, **reply}, out, seal=seal)

            reply, out = self._handler(session.role, op, header, tensors, encode)
            if isinstance(out, bytes):  # already a whole reply, from ``encode``
                return out
            return encode(reply or {}, out)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            extra = getattr(exc, "_ts_reply_extra", None) or {}
            return wire.encode({**wire.encode_error(exc, text), **extra}, seal=seal)

    def _watch(self, request: bytes, context, session: Session):
        """A stream that stays open until the client goes away (or this server stops).

        Its end is reported by a callback gRPC runs when the call ends, however it ends: code after a
        ``yield`` would not run when the client cancels while gRPC is still sending a message (gRPC then
        stops iterating the generator).
        """
        seq, _ = self._open(session, request, context)

        def ended() -> None:  # on a gRPC thread: must not block
            if not self._stopping.is_set() and self._on_watch_end is not None:
                self._on_watch_end(session.role)

        if not context.add_callback(ended):
            ended()  # the call already ended
            return iter(())
        return self._watch_open(context, wire.encode({"ok": True}, seal=session.sealer(seq, reply=True)))

    def _watch_open(self, context, first: bytes):
        yield first  # tells the client the stream is established
        while not self._stopping.wait(0.2):
            if not context.is_active():
                break

    def close(self, grace: float = 2.0) -> None:
        """Stops accepting calls, lets running ones finish for ``grace`` seconds, then cancels them."""
        if self._stopping.is_set():
            return
        with self._streams_lock:
            self._stopping.set()
            idle = [context for context, busy in self._streams.items() if not busy[0]]
        for context in idle:  # a stream answering a request ends after its reply
            context.cancel()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1.0)
