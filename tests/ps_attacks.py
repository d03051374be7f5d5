"""Attacks on a running parameter-server job, run as an outside process: ``python ps_attacks.py JSON``.

JSON: {"targets": {"ps:0": "host:port", ...}, "marker": path, "creds": {target: ...}}: "creds" are single-use
call credentials (and sealed messages) the test's chief made for this process with a chief's and a worker's
session, to check what an authenticated peer still cannot do. Prints one line ``RESULT {...}`` with what each
attempt got back. Used by test_parameter_server_security.py.
"""

from __future__ import annotations

import json
import pickle
import socket
import struct
import sys
import time

# How long a huge-claim attack waits for the server's gRPC answer (a bound, not a speed check: the 8
# such attacks stay within the 120 s the test gives this process; a server answers in milliseconds when
# the machine is idle, seconds when the test suite loads it).
_ANSWER_WITHIN = 14.0


class _CreatesFile:
    """Unpickling this creates ``path`` (what an attacker's payload would do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _raw_tcp(host: str, port: int, payload: bytes) -> str:
    """Sends ``payload`` on a plain TCP connection; returns how the server reacted."""
    with socket.create_connection((host, port), timeout=5) as s:
        try:
            s.sendall(payload)
            s.settimeout(5)
            got = b""
            while len(got) < 1 << 16:
                chunk = s.recv(4096)
                if not chunk:
                    return f"closed after {len(got)} bytes"
                got += chunk
            return "still open"
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
        except TimeoutError:
            return "timeout (nothing executed)"


def _grpc(address: str, method: str, body: bytes, token: str | None) -> str:
    import grpc

    md = (("x-ts-auth", token),) if token is not None else None
    with grpc.insecure_channel(address) as ch:
        try:
            ch.unary_unary(method)(body, timeout=10, metadata=md)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def _grpc_stream(address: str, method: str, body: bytes, token: str | None) -> str:
    """One message on a request stream (``.../Stream``): "OK", "REFUSED: <error>" for an error reply, or the
    status code of a stream the server did not open."""
    import grpc

    from torchstrategies.parameter_server.rpc import wire

    md = (("x-ts-auth", token),) if token is not None else None
    with grpc.insecure_channel(address) as ch:
        try:
            reply = next(ch.stream_stream(method)(iter([body]), timeout=10, metadata=md))
        except grpc.RpcError as exc:
            return exc.code().name
    header, _ = wire.decode(reply, offset=48 if reply[:4] == b"TSA2" else 0)  # skip the reply's MAC frame
    return "OK" if header.get("ok") else f"REFUSED: {header.get('error_message')}"


def _hpack_literal(name: str, value: str) -> bytes:
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack("!I", len(payload))[1:] + bytes([kind, flags]) + struct.pack("!I", stream) + payload


def _huge_grpc_claim(host: str, port: int, path: str, token: str | None, claim: int) -> str:
    """An HTTP/2 gRPC request whose 5-byte message prefix claims ``claim`` bytes, followed by a few."""
    headers = b"".join(
        _hpack_literal(k, v)
        for k, v in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{host}:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        + ([("x-ts-auth", token)] if token else [])
    )
    data = b"\x00" + struct.pack("!I", claim) + b"A" * 1024
    msg = (
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + _frame(4, 0, 0, b"")
        + _frame(1, 4, 1, headers)
        + _frame(0, 0, 1, data)
    )
    deadline = time.monotonic() + _ANSWER_WITHIN
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(msg)
        got = b""
        try:
            while True:  # until the answer, the connection's end, or the deadline (a server on a loaded
                # machine may send its HTTP/2 settings long before its answer)
                s.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if b"grpc-status" in got or b"\x00\x00\x00\x00\x03" in got:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    if b"grpc-status" in got:
        return "rejected (grpc-status)"
    return f"no grpc answer ({len(got)} bytes)"


EXEC = "/torchstrategies.ps.v1.Worker/Exec"
CREATE_OPTIMIZER = "/torchstrategies.ps.v1.ParameterServer/CreateOptimizer"
PUSH = "/torchstrategies.ps.v1.ParameterServer/Push"
WORKER_STREAM = "/torchstrategies.ps.v1.Worker/Stream"
PS_STREAM = "/torchstrategies.ps.v1.ParameterServer/Stream"


def main(spec: dict) -> dict:
    sys.path.insert(0, spec["root"])
    from torchstrategies.parameter_server.rpc import wire

    marker = spec["marker"]
    evil = pickle.dumps(_CreatesFile(marker))
    out: dict[str, dict[str, str]] = {}
    for name, address in spec["targets"].items():
        host, _, port = address.rpartition(":")
        creds = spec["creds"][name]
        r: dict[str, str] = {}
        # (a) the old attack: an 8-byte length and a pickle, on a raw connection.
        r["raw_pickle"] = _raw_tcp(host, int(port), struct.pack("!Q", len(evil)) + evil)
        # (a) gRPC without credentials, on every method that unpickles, raw and in the wire schema.
        for method in (EXEC, CREATE_OPTIMIZER):
            r[method + " raw"] = _grpc(address, method, evil, None)
            r[method + " wire"] = _grpc(
                address,
                method,
                wire.encode({"closure": evil, "defs": evil, "cls": evil, "groups": evil, "oid": 1}),
                None,
            )
            r[method + " wrong token"] = _grpc(address, method, evil, "0" * 64)
            # a worker's credentials do not open the chief's methods
            r[method + " task token"] = _grpc(address, method, evil, creds["task"][method])
        # (a) the same on the request streams: the Worker stream is the chief's; on the ps stream, a worker's
        # credentials open the stream but a chief-only method in it is refused before its body is unpickled.
        stream_body = wire.encode(
            {"op": "create_optimizer", "closure": evil, "defs": evil, "cls": evil, "groups": evil, "oid": 1}
        )
        for method in (WORKER_STREAM, PS_STREAM):
            r[method + " raw"] = _grpc_stream(address, method, evil, None)
            r[method + " wire"] = _grpc_stream(address, method, stream_body, None)
            r[method + " wrong token"] = _grpc_stream(address, method, stream_body, "0" * 64)
            sealed = bytes.fromhex(creds["task_messages"][method])  # sealed with the worker's session
            r[method + " task token"] = _grpc_stream(address, method, sealed, creds["task"][method])
        # (b) the old attack: a length header claiming 256 MiB.
        r["raw_huge_length"] = _raw_tcp(host, int(port), struct.pack("!Q", 256 << 20) + b"x" * 64)
        # (b) a gRPC message claiming 2 GiB - 1, without and with credentials.
        r["grpc_huge_claim"] = _huge_grpc_claim(host, int(port), PUSH, None, 0x7FFFFFFF)
        r["grpc_huge_claim_stream"] = _huge_grpc_claim(host, int(port), PS_STREAM, None, 0x7FFFFFFF)
        r["grpc_huge_claim_authenticated"] = _huge_grpc_claim(
            host, int(port), PUSH, creds["chief"][PUSH], 0x7FFFFFFF
        )
        r["grpc_huge_claim_stream_authenticated"] = _huge_grpc_claim(
            host, int(port), PS_STREAM, creds["chief"][PS_STREAM], 0x7FFFFFFF
        )
        out[name] = r
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))))
