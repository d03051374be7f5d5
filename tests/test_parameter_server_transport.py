"""The parameter server's wire format and gRPC transport on their own (in this process, fast)."""

from __future__ import annotations

import pytest
import torch

from torchstrategies.parameter_server.rpc import wire


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g).t(),  # not contiguous
        torch.randn(5, generator=g).bfloat16(),  # no numpy dtype
        torch.tensor([True, False, True]),
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
        torch.empty(0, 3),
        torch.randn(2, 2, dtype=torch.complex64, generator=g),
        torch.arange(-3, 3, dtype=torch.int8).reshape(2, 3),
        torch.randn(4, generator=g).half(),
        torch.arange(7, dtype=torch.int64)[::2],  # strided view
        torch.randn(2, 3, generator=g, requires_grad=True),
    ]


@pytest.mark.parametrize("copy", [True, False])
def test_wire_round_trips_every_dtype_and_layout(copy):
    sent = _tensors()
    header = {"op": "push", "entries": [["1/0", "dense"]], "blob": b"\x00\xff", "n": None}
    got_header, got = wire.decode(wire.encode(header, sent), copy=copy)
    assert got_header == header
    assert len(got) == len(sent)
    for a, b in zip(sent, got, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and not b.requires_grad
        assert torch.equal(b, a.detach()), (a, b)


def test_wire_decode_copy_owns_its_memory():
    t = torch.arange(4, dtype=torch.float32)
    data = bytearray(wire.encode({}, [t]))
    _, (owned,) = wire.decode(bytes(data))
    owned.add_(1)  # writable, and not a view of the message
    _, (again,) = wire.decode(bytes(data))
    assert again.tolist() == [0, 1, 2, 3] and owned.tolist() == [1, 2, 3, 4]


# ---- the transport: RpcServer and RpcClient in this process --------------------------------------------
SECRET = b"transport-test-secret-0123456789"


class _Served:
    """An RpcServer with a ps-like handler that records what it ran."""

    def __init__(self, services=("ParameterServer", "Worker", "Control")):
        import threading

        from torchstrategies.parameter_server.rpc.auth import JobAuth
        from torchstrategies.parameter_server.rpc.transport import RpcServer, call_abandoned

        self.auth = JobAuth(SECRET)
        self.ran: list[tuple[str, str]] = []
        self.abandoned = threading.Event()
        self.release = threading.Event()

        def handler(role, op, header, tensors, encode):
            self.ran.append((role, op))
            if op == "pull":
                return {"echo": header.get("keys")}, [t * 2 for t in tensors] or [torch.arange(3.0)]
            if op == "push" and header.get("sleep"):
                while not self.release.wait(0.05):
                    if call_abandoned():
                        self.abandoned.set()
                        break
                return {}, []
            if op == "push" and header.get("fail"):
                raise KeyError("no such shard")
            return {"role": role}, []

        self.server = RpcServer(handler, services, "127.0.0.1", self.auth, "ps:0|instance-1")
        self.address = f"127.0.0.1:{self.server.port}"

    def client(self, role="task", timeout=10.0, auth=None, instance="instance-1"):
        from torchstrategies.parameter_server.rpc.client import RpcClient

        return RpcClient(self.address, "ps:0", timeout, auth or self.auth, role, instance=instance,
                         hello={"op": "hello"})


@pytest.fixture(params=["own-thread", "queue"])
def served(request, monkeypatch):
    """Both stream implementations: the caller-driven one and gRPC's public API (the fallback)."""
    from torchstrategies.parameter_server.rpc import streams

    monkeypatch.setattr(streams, "_use_own_thread", request.param == "own-thread")
    s = _Served()
    yield s
    s.release.set()
    s.server.close(grace=0.5)


@pytest.mark.timeout(60)
def test_requests_travel_on_reused_streams_and_keep_their_order(served):
    import threading

    c = served.client()
    for i in range(20):  # one stream, reused: each reply answers its own request
        reply, (out,) = c.call({"op": "pull", "keys": [f"{i}/0"]}, [torch.full((2,), float(i))])
        assert reply["echo"] == [f"{i}/0"] and out.tolist() == [2.0 * i, 2.0 * i]
    assert len(served.server._streams) == 1
    errors: list[BaseException] = []

    def hammer(k):
        try:
            for i in range(10):
                reply, (out,) = c.call({"op": "pull", "keys": [k]}, [torch.full((1,), float(i))])
                assert reply["echo"] == [k] and out.item() == 2.0 * i
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(f"t{j}",)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert 1 <= len(served.server._streams) <= 4  # concurrent callers used their own streams
    with pytest.raises(Exception) as info:  # a handler's error comes back, the stream stays usable
        from torchstrategies.parameter_server.rpc.transport import RemoteError

        c.call({"op": "push", "fail": True})
    assert isinstance(info.value, RemoteError) and isinstance(info.value.exc, KeyError)
    assert c.call({"op": "pull"})[1][0].tolist() == [0.0, 1.0, 2.0]
    c.close()


@pytest.mark.timeout(60)
def test_a_late_reply_is_a_deadline_error_and_an_abort_cancels_the_call(served):
    import threading

    from torchstrategies.errors import CancelledError, DeadlineExceededError, UnavailableError

    c = served.client(timeout=0.5)
    with pytest.raises(DeadlineExceededError, match="did not answer 'push' within 0.5s"):
        c.call({"op": "push", "sleep": True})
    assert c.broken
    with pytest.raises(UnavailableError):  # a client that missed a deadline stays failed
        c.call({"op": "pull"})
    assert served.abandoned.wait(10)  # the server saw the request abandoned (the stream was cancelled)
    c.close()
    served.abandoned.clear()
    c = served.client()
    abort = threading.Event()
    threading.Timer(0.3, abort.set).start()
    with pytest.raises(CancelledError, match="abandoned"):
        c.call({"op": "push", "sleep": True}, timeout=None, abort=abort)
    assert served.abandoned.wait(10) and not c.broken
    served.release.set()
    assert c.call({"op": "pull"})[1][0].tolist() == [0.0, 1.0, 2.0]  # a new stream
    c.close()


def _stream(address: str, path: str, credential: str | None, message: bytes) -> str:
    """Sends one message on a new stream of ``path``: "OK" (a reply came) or the status code's name."""
    import grpc

    md = None if credential is None else (("x-ts-auth", credential),)
    with grpc.insecure_channel(address) as ch:
        try:
            next(ch.stream_stream(path)(iter([message]), metadata=md, timeout=10))
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


@pytest.mark.timeout(60)
def test_streams_are_authenticated_and_authorised_before_a_request_is_read(served):
    import grpc

    from torchstrategies.errors import UnavailableError
    from torchstrategies.parameter_server.rpc import wire
    from torchstrategies.parameter_server.rpc.session import Session
    from torchstrategies.parameter_server.rpc.transport import RemoteError

    task = served.client("task")
    with pytest.raises(RemoteError, match="for the chief only"):  # a chief-only method on the ps stream
        task.call({"op": "create_optimizer", "cls": b"\x80\x04evil", "groups": b"", "oid": 1})
    with pytest.raises(UnavailableError, match="PERMISSION_DENIED"):  # the Worker stream is the chief's
        task.call({"op": "exec", "closure": b"\x80\x04evil"})
    assert ("task", "create_optimizer") not in served.ran and ("task", "exec") not in served.ran
    chief = served.client("chief")
    assert chief.call({"op": "setup"})[0]["role"] == "chief"
    assert ("chief", "setup") in served.ran
    before = list(served.ran)
    path = "/torchstrategies.ps.v1.Worker/Stream"
    body = wire.encode({"op": "exec", "closure": b"\x80\x04evil"})
    stranger = Session(b"s" * 16, b"another job's session key 012345", "chief")  # not this job's key
    used = chief._credential(path)[0][1]
    setup = wire.encode({"op": "setup"}, seal=chief._session.sealer(chief._session.next_seq()))
    assert _stream(served.address, path, used, setup) == "OK"  # the chief's own credential, once
    before = list(served.ran)
    for credential in (None, "0" * 64, stranger.call_credential(path), used):  # ... and never again
        assert _stream(served.address, path, credential, body) == "UNAUTHENTICATED", credential
    # A fresh credential opens the stream, but a message must carry its own single-use MAC.
    for message in (body, setup, wire.encode({"op": "setup"}, seal=stranger.sealer(1))):
        assert _stream(served.address, path, chief._credential(path)[0][1], message) == "UNAUTHENTICATED"
    # A unary request's body names its method, under the MAC: moved to another method, it is refused.
    pull = wire.encode({"op": "pull"}, seal=chief._session.sealer(chief._session.next_seq()))
    with grpc.insecure_channel(served.address) as ch:
        reply = ch.unary_unary("/torchstrategies.ps.v1.ParameterServer/Push")(
            pull, metadata=chief._credential("/torchstrategies.ps.v1.ParameterServer/Push"), timeout=10)
    assert "'pull' request arrived on the 'push' method" in wire.decode(reply, offset=48)[0]["error_message"]
    assert served.ran == before  # nothing reached the handler
    task.close()
    chief.close()


@pytest.mark.timeout(60)
def test_closing_either_side_fails_later_calls_with_a_named_error(served):
    from torchstrategies.errors import UnavailableError

    c = served.client()
    c.call({"op": "pull"})
    c.close()
    with pytest.raises(UnavailableError, match="ps:0"):
        c.call({"op": "pull"})
    c = served.client()
    c.call({"op": "pull"})
    served.server.close(grace=0.5)  # cancels the idle stream at once
    assert not served.server._streams
    with pytest.raises(UnavailableError, match="ps:0"):
        c.call({"op": "pull"})
    c.close()


@pytest.mark.timeout(120)
def test_every_watch_stream_end_is_reported_even_when_the_client_cancels_at_once():
    """A chief that goes away right after its Watch stream opened is reported through the stream's end,
    every time (the code after the generator's ``yield`` used not to run when gRPC was still completing the
    first send as the client cancelled: 5-8 of 100 ends were then only noticed by the 30 s lease)."""
    import threading

    from torchstrategies.parameter_server.rpc.auth import JobAuth
    from torchstrategies.parameter_server.rpc.client import RpcClient
    from torchstrategies.parameter_server.rpc.transport import RpcServer

    auth = JobAuth(SECRET)
    ended = threading.Semaphore(0)
    server = RpcServer(lambda *a: ({}, []), ("Worker", "Control"), "127.0.0.1", auth, "worker:0|i",
                       on_watch_end=lambda role: ended.release())
    try:
        for i in range(60):
            chief = RpcClient(f"127.0.0.1:{server.port}", "worker:0", 10.0, auth, "chief", instance="i")
            chief.watch()
            chief.close()
            assert ended.acquire(timeout=20), f"the end of Watch stream {i} was not reported"
    finally:
        server.close(grace=0.5)
