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
one request and its reply at a time (:mod:`streams`): this is what :class:`RpcClient` uses for every
ParameterServer and Worker method, so a training step pays gRPC's per-call set-up only once per stream.
A stream is authenticated when it opens, by the same interceptor and before any of its messages is read;
each message names its method (``op``), which the server checks against the stream's service and the
caller's role (a chief-only method from a worker's stream is refused, its body never unpickled). Each
request still has its deadline: the client cancels a stream whose reply is late.

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
import time
import traceback
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import torch

from torchstrategies.errors import CancelledError, DeadlineExceededError, UnavailableError
from torchstrategies.strategies.parameter_server import wire
from torchstrategies.strategies.parameter_server.auth import AUTH_KEY, CHIEF, JobAuth
from torchstrategies.strategies.parameter_server.session import (
    FRAME,
    HELLO_KEY,
    AuthError,
    OpenSession,
    Session,
    SessionTable,
    client_hello,
    client_session,
)
from torchstrategies.strategies.parameter_server.streams import StreamExpired, StreamPool

__all__ = ["RpcServer", "RpcClient", "RemoteError", "max_message_bytes", "call_abandoned", "METHODS"]

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
_WATCH = f"/{_PKG}.Control/Watch"
_HANDSHAKE = f"/{_PKG}.Auth/Handshake"
_PATH = {op: f"/{_PKG}.{svc}/{m}" for op, (svc, m) in METHODS.items()}
# The services whose methods also travel on a long-lived stream (``/<pkg>.<Service>/Stream``).
STREAM_SERVICES = ("ParameterServer", "Worker")
_STREAM = {svc: f"/{_PKG}.{svc}/Stream" for svc in STREAM_SERVICES}
# What only the chief may call: everything that unpickles (exec, setup, optimizers) or controls the task.
_CHIEF_ONLY = {
    _PATH[op]
    for op in ("create", "create_optimizer", "set_hparams", "stats", "setup", "exec", "heartbeat", "shutdown")
} | {_WATCH, _STREAM["Worker"]}


_malloc_tuned = False


def tune_malloc() -> None:
    """Keeps freed large buffers in the heap instead of returning them to the kernel (glibc only).

    Every gRPC message of a few MB is copied through fresh buffers (the request bytes, gRPC's slices, the
    reply bytes); with glibc's defaults each is a new ``mmap`` whose pages fault in and are zeroed on first
    touch, which costs more than the copy itself. Raising the mmap threshold to its maximum (32 MiB) and the
    trim threshold lets the heap reuse those pages. Called once by every parameter-server task; set
    ``TORCHSTRATEGIES_PS_TUNE_MALLOC=0`` to leave malloc alone.
    """
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("TORCHSTRATEGIES_PS_TUNE_MALLOC", "1") == "0":
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


def _options(server: bool) -> list[tuple[str, Any]]:
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
        if method == _HANDSHAKE:
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
            options=_options(True),
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
                if _PATH[op] in _CHIEF_ONLY and session.role != CHIEF:
                    raise PermissionError(f"{_PATH[op]} is for the chief only")
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


# ---- client --------------------------------------------------------------------------------------------
class RpcClient:
    """One channel to a peer task; ``call`` is thread-safe and concurrent calls share the channel.

    Construction runs the handshake (waiting up to ``timeout`` for the server): the server must prove that it
    holds the job secret and is ``name|instance`` (``instance``: from the task's rendezvous entry), else
    :class:`UnavailableError`. A deadline or transport failure marks the client broken and raises (naming
    ``name``); later calls fail at once with the same error.
    """

    def __init__(
        self,
        address: str,
        name: str,
        timeout: float,
        auth: JobAuth,
        role: str,
        *,
        instance: str,
        hello: dict | None = None,
    ):
        self.name = name
        self.address = address
        self.timeout = timeout
        self.identity = f"{name}|{instance}"
        self._broken: str | None = None
        self._max = max_message_bytes()
        tune_malloc()
        self._channel = self._new_channel(address, auth, _options(False))
        self._watch_call = None
        try:
            self._session = self._handshake(auth, role, timeout)
        except BaseException:
            self._channel.close()
            raise
        self._stubs = {op: self._channel.unary_unary(path) for op, path in _PATH.items()}
        self._streams = StreamPool(self._channel, self._credential)
        if hello is not None:
            try:
                self.call(hello)
            except BaseException:
                self.close()
                raise

    @staticmethod
    def _new_channel(address: str, auth: JobAuth, opts: list[tuple[str, Any]]) -> grpc.Channel:
        if auth.tls:
            if auth.tls_server_name:
                opts = [*opts, ("grpc.ssl_target_name_override", auth.tls_server_name)]
            return grpc.secure_channel(address, auth.channel_credentials(), options=opts)
        return grpc.insecure_channel(address, options=opts)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def _handshake(self, auth: JobAuth, role: str, timeout: float) -> Session:
        """Waits for the server, then runs the handshake (:mod:`session`) on a channel of its own whose
        replies are bounded to a few bytes: nothing larger is read from a peer not yet authenticated."""
        hello, nonce = client_hello(role)
        opts = [o for o in _options(False) if o[0] != "grpc.max_receive_message_length"]
        channel = self._new_channel(self.address, auth, [*opts, ("grpc.max_receive_message_length", 1024)])
        deadline = time.monotonic() + timeout
        try:
            call = channel.stream_unary(_HANDSHAKE)
            while True:
                try:
                    reply = call(
                        iter(()),
                        timeout=max(0.1, deadline - time.monotonic()),
                        metadata=((HELLO_KEY, hello),),
                        wait_for_ready=True,
                    )
                    break
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        raise UnavailableError(
                            f"{self.name} at {self.address} rejected this job's credentials: {exc.details()}"
                        ) from None
                    if time.monotonic() >= deadline:
                        raise UnavailableError(
                            f"cannot reach {self.name} at {self.address} within {timeout:.1f}s: {exc.code().name}"
                        ) from None
                time.sleep(0.05)
        finally:
            channel.close()
        if auth.secret is None:
            if reply:
                raise UnavailableError(f"{self.name} at {self.address} expects a job secret; this task has none")
            return OpenSession()
        try:
            return client_session(auth.secret, self.identity, role, nonce, reply)
        except AuthError as exc:
            raise UnavailableError(f"{self.name} at {self.address}: {exc}") from None

    def _credential(self, path: str) -> tuple[tuple[str, str], ...]:
        return ((AUTH_KEY, self._session.call_credential(path)),)

    def _request(self, header: dict, tensors: list[torch.Tensor] | None) -> tuple[int, bytes]:
        seq = self._session.next_seq()
        data = wire.encode(header, tensors, seal=self._session.sealer(seq))
        if len(data) > self._max:
            raise ValueError(
                f"a {header.get('op')!r} request to {self.name} is {len(data)} bytes, over the "
                f"{self._max}-byte limit (TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES)"
            )
        return seq, data

    def _fail(self, exc: grpc.RpcError, op: str, t: float | None) -> BaseException:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._broken = f"{self.name} at {self.address} did not answer {op!r} within {t or 0:.1f}s"
            return DeadlineExceededError(self._broken)
        if code == grpc.StatusCode.CANCELLED and self._broken is None:
            return CancelledError(f"{op!r} to {self.name} was cancelled")
        self._broken = self._broken or (
            f"{self.name} at {self.address} is unavailable ({code.name}: {exc.details()}) during {op!r}"
        )
        return UnavailableError(self._broken)

    def _reply(self, data: bytes, seq: int) -> tuple[dict, list[torch.Tensor]]:
        try:
            _, covered = self._session.open(data, reply_to=seq)
        except AuthError as exc:
            self._broken = f"{self.name} at {self.address} sent a reply that does not authenticate: {exc}"
            raise UnavailableError(self._broken) from None
        reply, out = wire.decode(data, offset=FRAME, covered=covered)
        if not reply.get("ok", False):
            raise RemoteError(wire.decode_error(reply), str(reply.get("text", "")), reply)
        return reply, out

    def call(
        self,
        header: dict,
        tensors: list[torch.Tensor] | None = None,
        timeout: float | None | str = "default",
        abort: threading.Event | None = None,
    ) -> tuple[dict, list[torch.Tensor]]:
        """Sends a request and waits for its reply.

        ``timeout=None`` waits as long as the peer lives and ``abort`` is not set (then the call is
        cancelled and :class:`CancelledError` raised).
        """
        if self._broken is not None:
            raise UnavailableError(self._broken)
        op = header["op"]
        t = self.timeout if timeout == "default" else timeout
        seq, data = self._request(header, tensors)
        service = METHODS[op][0]
        if service in _STREAM:
            return self._reply(self._exchange(service, op, data, t, abort), seq)  # type: ignore[arg-type]
        stub = self._stubs[op]
        try:
            metadata = self._credential(_PATH[op])
            if t is not None or abort is None:
                out = stub(data, timeout=t, metadata=metadata)  # type: ignore[arg-type]
            else:
                fut = stub.future(data, metadata=metadata)
                while True:
                    try:
                        out = fut.result(timeout=0.2)
                        break
                    except grpc.FutureTimeoutError:
                        if abort.is_set():
                            fut.cancel()
                            raise CancelledError(f"{op!r} on {self.name} was abandoned") from None
        except grpc.RpcError as exc:
            raise self._fail(exc, op, t) from None  # type: ignore[arg-type]
        return self._reply(out, seq)

    def _exchange(
        self, service: str, op: str, data: bytes, t: float | None, abort: threading.Event | None
    ) -> bytes:
        """One request on a stream of ``service`` (see :mod:`streams`)."""
        try:
            return self._streams.exchange(_STREAM[service], data, t, abort)
        except StreamExpired as exc:
            if exc.why == "abort":
                raise CancelledError(f"{op!r} on {self.name} was abandoned") from None
            self._broken = f"{self.name} at {self.address} did not answer {op!r} within {t or 0:.1f}s"
            raise DeadlineExceededError(self._broken) from None
        except grpc.RpcError as exc:  # a stream is only cancelled by us (above), by close() or by the server
            self._broken = self._broken or (
                f"{self.name} at {self.address} is unavailable ({exc.code().name}: {exc.details()}) during {op!r}"
            )
            raise UnavailableError(self._broken) from None
        except (RuntimeError, ValueError):  # the pool or the channel was closed: this client is closed
            raise UnavailableError(self._broken or f"connection to {self.name} closed") from None

    def call_async(self, header: dict, timeout: float, done: Callable[[BaseException | None], None]) -> None:
        """Starts a small call (heartbeat, shutdown) and runs ``done(error or None)`` when it ends."""
        op = header["op"]
        if self._broken is not None:
            done(UnavailableError(self._broken))
            return
        seq, data = self._request(header, None)
        fut = self._stubs[op].future(data, timeout=timeout, metadata=self._credential(_PATH[op]))

        def finished(f) -> None:
            try:
                self._reply(f.result(), seq)
                done(None)
            except grpc.RpcError as exc:
                done(self._fail(exc, op, timeout))
            except BaseException as exc:  # noqa: BLE001
                done(exc)

        fut.add_done_callback(finished)

    def watch(self) -> None:
        """Opens the Watch stream and waits (at most ``timeout``) until the server has it: from then on the
        server learns at once when this process goes away. The stream has no deadline: it lives as long
        as the job."""
        seq, data = self._request({"op": "watch"}, None)
        call = self._channel.unary_stream(_WATCH)(data, metadata=self._credential(_WATCH))
        self._watch_call = call
        opened = threading.Event()

        def first() -> None:
            try:
                self._reply(next(call), seq)
                opened.set()
            except Exception:  # noqa: BLE001 - cancelled, unauthenticated or the peer went away: reported below
                pass

        threading.Thread(target=first, name=f"watch-{self.name}", daemon=True).start()
        if not opened.wait(self.timeout):
            raise UnavailableError(
                f"{self.name} at {self.address} did not open the Watch stream within {self.timeout:.1f}s"
            )

    def mark_broken(self, why: str) -> None:
        """Fails every later call with ``why`` without closing the channel (safe inside a gRPC callback,
        where closing the channel would deadlock; :meth:`close` it later from another thread)."""
        self._broken = self._broken or why

    def close(self) -> None:
        self._broken = self._broken or f"connection to {self.name} closed"
        if self._watch_call is not None:
            self._watch_call.cancel()
        self._streams.close()
        self._channel.close()
