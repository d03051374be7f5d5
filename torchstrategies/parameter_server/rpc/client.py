"""The client side of the parameter server's transport: one channel to a peer task (see ``transport.py``).

:class:`RpcClient` runs the handshake when it is made (:mod:`session`), then sends each request with a
single-use credential and MAC, on a request stream (:mod:`streams`) for the ParameterServer and Worker
methods and as a unary call for the Control methods, and checks each reply's MAC before decoding it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from torchstrategies.errors import CancelledError, DeadlineExceededError, UnavailableError
from torchstrategies.parameter_server.rpc import wire
from torchstrategies.parameter_server.rpc.auth import AUTH_KEY, JobAuth
from torchstrategies.parameter_server.rpc.session import (
    FRAME,
    HELLO_KEY,
    AuthError,
    OpenSession,
    Session,
    client_hello,
    client_session,
)
from torchstrategies.parameter_server.rpc.streams import Abort, StreamExpired, StreamPool
from torchstrategies.parameter_server.rpc.transport import (
    HANDSHAKE_PATH,
    METHODS,
    PATHS,
    STREAM_PATHS,
    WATCH_PATH,
    RemoteError,
    channel_options,
    max_message_bytes,
    tune_malloc,
)

__all__ = ["RpcClient"]


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
        self._channel = self._new_channel(address, auth, channel_options(False))
        self._watch_call = None
        try:
            self._session = self._handshake(auth, role, timeout)
        except BaseException:
            self._channel.close()
            raise
        self._stubs = {op: self._channel.unary_unary(path) for op, path in PATHS.items()}
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
        opts = [o for o in channel_options(False) if o[0] != "grpc.max_receive_message_length"]
        channel = self._new_channel(self.address, auth, [*opts, ("grpc.max_receive_message_length", 1024)])
        deadline = time.monotonic() + timeout
        try:
            call = channel.stream_unary(HANDSHAKE_PATH)
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
        abort: Abort | None = None,
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
        if service in STREAM_PATHS:
            return self._reply(self._exchange(service, op, data, t, abort), seq)  # type: ignore[arg-type]
        stub = self._stubs[op]
        try:
            metadata = self._credential(PATHS[op])
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
        self, service: str, op: str, data: bytes, t: float | None, abort: Abort | None
    ) -> bytes:
        """One request on a stream of ``service`` (see :mod:`streams`)."""
        try:
            return self._streams.exchange(STREAM_PATHS[service], data, t, abort)
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
        fut = self._stubs[op].future(data, timeout=timeout, metadata=self._credential(PATHS[op]))

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
        call = self._channel.unary_stream(WATCH_PATH)(data, metadata=self._credential(WATCH_PATH))
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
