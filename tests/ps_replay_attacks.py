"""Replay attacks on a running parameter-server job, as outside processes without the job secret.

``python ps_replay_attacks.py MODE JSON``; used by test_parameter_server_replay.py:

* ``tap``: the network. An HTTP CONNECT proxy (the job's tasks get ``grpc_proxy`` pointing at it) that
  forwards every connection unchanged and writes what each client sent to ``<dir>/<n>.bin`` (the target in
  ``<n>.target``): exactly the bytes a passive sniffer on a network without TLS records. Prints
  ``PORT <port>``, then runs until killed.
* ``replay``: replays each recorded connection byte for byte to its target, ``times`` times (new TCP
  connections, all at once), and reads what comes back. Prints ``RESULT {...}``.
* ``stale``: puts a task's older signed entry back into the rendezvous store and listens on the task's old
  address with a gRPC relay to its new address, recording every call it relays; prints ``READY``, waits for
  a line on stdin, then uses what it recorded (every credential, every message) against the real tasks, and
  prints ``RESULT {...}``.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import sys
import threading

EXEC = "/torchstrategies.ps.v1.Worker/Exec"
WORKER_STREAM = "/torchstrategies.ps.v1.Worker/Stream"


class _CreatesFile:
    """Unpickling this creates ``path`` (what an attacker's payload would do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# ---- tap ------------------------------------------------------------------------------------------------
def _pump(src: socket.socket, dst: socket.socket, record) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if record is not None:
                record.write(data)
                record.flush()
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _tunnel(client: socket.socket, n: int, directory: str) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = client.recv(4096)
        if not chunk:
            return
        head += chunk
    head, rest = head.split(b"\r\n\r\n", 1)
    target = head.split(b"\r\n")[0].split()[1].decode()  # CONNECT host:port HTTP/1.1
    host, _, port = target.rpartition(":")
    upstream = socket.create_connection((host, int(port)))
    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
    with open(os.path.join(directory, f"{n}.target"), "w") as f:
        f.write(target)
    record = open(os.path.join(directory, f"{n}.bin"), "wb")  # noqa: SIM115 - closed when the tunnel ends
    if rest:
        record.write(rest)
        upstream.sendall(rest)
    back = threading.Thread(target=_pump, args=(upstream, client, None), daemon=True)
    back.start()
    _pump(client, upstream, record)
    back.join()
    record.close()


def tap(spec: dict) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    print(f"PORT {server.getsockname()[1]}", flush=True)
    for n in range(1 << 30):
        client, _ = server.accept()
        threading.Thread(target=_tunnel, args=(client, n, spec["dir"]), daemon=True).start()


# ---- replay ---------------------------------------------------------------------------------------------
def _replay_once(target: str, data: bytes, out: list) -> None:
    host, _, port = target.rpartition(":")
    got = 0
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(data)
            s.settimeout(3.0)  # read the answers until the server has been quiet for 3 s
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += len(chunk)
    except OSError:
        pass
    out.append(got)


def replay(spec: dict) -> dict:
    directory, times = spec["dir"], int(spec["times"])
    recorded = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".bin"):
            n = name[: -len(".bin")]
            with open(os.path.join(directory, f"{n}.target")) as f:
                target = f.read()
            with open(os.path.join(directory, name), "rb") as f:
                recorded[n] = (target, f.read())
    answers: dict[str, list] = {n: [] for n in recorded}
    threads = [
        threading.Thread(target=_replay_once, args=(target, data, answers[n]))
        for n, (target, data) in recorded.items()
        if data
        for _ in range(times)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return {
        "connections": {n: {"target": t, "bytes": len(d), "answered": answers[n]} for n, (t, d) in recorded.items()}
    }


# ---- stale entry + relay on the old address -------------------------------------------------------------
def _relay_server(listen: str, upstream: str, log: list):
    """A gRPC server on ``listen`` that forwards every call to ``upstream`` and records it."""
    from concurrent import futures

    import grpc

    channel = grpc.insecure_channel(upstream)

    class Relay(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method
            md = [(k, v) for k, v in details.invocation_metadata if k.startswith("x-ts-")]
            entry = {"method": method, "metadata": md, "requests": [], "replies": []}
            log.append(entry)

            def forward(requests, context):
                def recorded():
                    for r in requests:
                        entry["requests"].append(r)
                        yield r

                try:
                    for reply in channel.stream_stream(method)(recorded(), metadata=md, timeout=30):
                        entry["replies"].append(reply)
                        yield reply
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details() or "")

            return grpc.stream_stream_rpc_method_handler(forward)

    server = grpc.server(futures.ThreadPoolExecutor(16))
    server.add_generic_rpc_handlers([Relay()])
    if not server.add_insecure_port(listen):
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server


def _call(address: str, method: str, metadata, messages: list[bytes]) -> str:
    import grpc

    with grpc.insecure_channel(address) as ch:
        try:
            for _ in ch.stream_stream(method)(iter(messages), metadata=metadata or None, timeout=10):
                pass
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def stale(spec: dict) -> dict:
    import torch.distributed as dist

    host, port = spec["store"]
    store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    store.set(spec["key"], spec["old_entry"])  # the task's entry from before it restarted
    log: list[dict] = []
    relay = _relay_server(spec["listen"], spec["relay_to"], log)
    print("READY", flush=True)
    sys.stdin.readline()  # the chief has had its chance to use the replayed entry
    relay.stop(0)
    evil = pickle.dumps(_CreatesFile(spec["marker"]))
    from torchstrategies.parameter_server.rpc import wire

    evil_exec = wire.encode({"op": "exec", "closure": evil, "defs": evil})
    tried: dict[str, str] = {}
    seen_md = [e["metadata"] for e in log]
    seen_messages = [m for e in log for m in e["requests"]]
    for target in spec["targets"]:
        for i, md in enumerate(seen_md):  # every credential the chief sent, with the attacker's payload ...
            tried[f"{target} exec with credential {i}"] = _call(target, EXEC, md, [evil_exec])
            tried[f"{target} stream with credential {i}"] = _call(target, WORKER_STREAM, md, [evil_exec])
            for j, message in enumerate(seen_messages):  # ... and with every message the chief sent
                tried[f"{target} stream with credential {i}, message {j}"] = _call(
                    target, WORKER_STREAM, md, [message]
                )
        tried[f"{target} exec without credential"] = _call(target, EXEC, [], [evil_exec])
    return {
        "relayed": [{"method": e["method"], "metadata": e["metadata"], "requests": len(e["requests"])} for e in log],
        "tried": tried,
        "marker_exists": os.path.exists(spec["marker"]),
    }


if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, spec.get("root", "."))
    if mode == "tap":
        tap(spec)
    elif mode == "replay":
        print("RESULT " + json.dumps(replay(spec)), flush=True)
    elif mode == "stale":
        print("RESULT " + json.dumps(stale(spec)), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
