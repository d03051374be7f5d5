"""The attacks of issue 13, replayed against a running job (chief, 1 ps, 1 worker on 127.0.0.1).

An outside process without the job secret (tests/ps_attacks.py) sends (a) a pickle that would create a file,
to every method that unpickles and as the old transport's raw framing, and (b) messages whose length prefix
claims 256 MiB / 2 GiB. Nothing may execute, the tasks' memory may not grow by the claimed sizes, and the
job must keep training afterwards with no update lost. Also: no task listens on a wildcard address, and an
address written into the rendezvous store by a stranger is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import torch
from _ps_bodies import counter_model
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.parameter_server.rpc import wire
from torchstrategies.parameter_server.rpc.auth import JobAuth

SECRET = "test-job-secret-0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 4 << 20


def _listening(pid: int) -> list[str]:
    """The local addresses a process listens on (an IPv4-mapped IPv6 socket counts as its IPv4 address)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == "LISTEN"})


def _credentials(address: str, name: str, instance: str, auth) -> dict:
    """Single-use credentials and sealed messages for the attacker, made with a chief's and a worker's session
    to ``name``: what a peer of the job (or a stranger who somehow got one) could send."""
    from torchstrategies.parameter_server.rpc.client import RpcClient

    paths = {m: f"/torchstrategies.ps.v1.{m}" for m in ("Worker/Exec", "ParameterServer/CreateOptimizer",
                                                       "Worker/Stream", "ParameterServer/Stream",
                                                       "ParameterServer/Push")}
    out = {}
    for role in ("chief", "task"):
        client = RpcClient(address, name, 10.0, auth, role, instance=instance)
        out[role] = {p: client._credential(p)[0][1] for p in paths.values()}
        if role == "task":
            evil = {"closure": b"\x80\x04evil", "defs": b"\x80\x04evil", "cls": b"\x80\x04evil",
                    "groups": b"\x80\x04evil", "oid": 1}
            session = client._session
            out["task_messages"] = {
                paths["Worker/Stream"]: wire.encode({"op": "exec", **evil},
                                                    seal=session.sealer(session.next_seq())).hex(),
                paths["ParameterServer/Stream"]: wire.encode({"op": "create_optimizer", **evil},
                                                             seal=session.sealer(session.next_seq())).hex(),
            }
        client.close()
    return out


def _chief(strategy, pid_dir, marker):
    import datetime

    import grpc
    import torch.distributed as dist

    from torchstrategies.errors import UnavailableError
    from torchstrategies.parameter_server.rpc.auth import TASK
    from torchstrategies.parameter_server.rpc.client import RpcClient
    from torchstrategies.parameter_server.rpc.rendezvous import entry_key

    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    model, _, step = counter_model(strategy)
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    pids = {n: int(open(os.path.join(pid_dir, n)).read()) for n in ("ps0", "worker0")}
    rss_before = {n: psutil.Process(p).memory_info().rss for n, p in pids.items()}
    targets = {"ps:0": strategy._ps_addresses[0], "worker:0": strategy._workers[0].latest.address}
    instances = {"ps:0": strategy._ps_entries[0][1], "worker:0": strategy._workers[0].latest.instance}
    auth = strategy._auth
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHSTRATEGIES_PS_SECRET")}
    creds = {name: _credentials(address, name, instances[name], auth) for name, address in targets.items()}
    spec = {"targets": targets, "marker": marker, "root": ROOT, "creds": creds}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "ps_attacks.py"), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    attacks = json.loads(proc.stdout.strip().splitlines()[-1][len("RESULT ") :])
    # An authenticated message over the size limit is refused by the ps (our own client refuses to send it).
    push = "/torchstrategies.ps.v1.ParameterServer/Push"
    task = RpcClient(targets["ps:0"], "ps:0", 10.0, auth, TASK, instance=instances["ps:0"])
    with grpc.insecure_channel(targets["ps:0"], options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        big = wire.encode({"oid": 1, "entries": []}, [torch.zeros(LIMIT // 4 + 1024)],
                          seal=task._session.sealer(task._session.next_seq()))
        try:
            ch.unary_unary(push)(big, timeout=10, metadata=task._credential(push))
            oversized = "OK"
        except grpc.RpcError as exc:
            oversized = exc.code().name
    task.close()
    # A stranger overwrites worker 0's address in the store: the chief refuses the entry.
    key = entry_key("worker", 0)
    store = dist.TCPStore(
        strategy._cluster_resolver.master_addr,
        strategy._cluster_resolver.master_port,
        None,
        False,
        datetime.timedelta(seconds=10),
    )
    original = store.get(key)
    store.set(key, "127.0.0.1:9|evil")
    try:
        strategy._server_address("worker", 0)
        tampered = "accepted"
    except UnavailableError as exc:
        tampered = str(exc)
    store.set(key, original)
    rss_after = {n: psutil.Process(p).memory_info().rss for n, p in pids.items()}
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    return {
        "attacks": attacks,
        "oversized": oversized,
        "tampered": tampered,
        "marker_exists": os.path.exists(marker),
        "rss_growth": {n: rss_after[n] - rss_before[n] for n in pids},
        "weight": float(model.weight.detach().reshape(())),
        "listening": {n: _listening(p) for n, p in pids.items()} | {"chief": _listening(os.getpid())},
    }


def _cluster(rank, world_size, pid_dir, marker):
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type != "chief":
        with open(os.path.join(pid_dir, f"{resolver.task_type}{resolver.task_id}"), "w") as f:
            f.write(str(os.getpid()))
        ts.distribute.Server(resolver, timeout=60, lease_timeout=30).join()
        return resolver.task_type
    strategy = ts.ParameterServerStrategy(resolver, timeout=20)
    try:
        return _chief(strategy, pid_dir, marker)
    finally:
        strategy.shutdown()


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack")
    marker = str(tmp / "pwned")
    env = {"TORCHSTRATEGIES_PS_SECRET": SECRET, "TORCHSTRATEGIES_PS_MAX_MESSAGE_BYTES": str(LIMIT)}
    results = run_ranks(_cluster, 3, args=(str(tmp), marker), init_process_group=False, timeout=200, env=env)
    return results[0]


@pytest.mark.timeout(260)
def test_unauthenticated_pickle_executes_nothing(attacked):
    assert attacked["marker_exists"] is False
    for task, r in attacked["attacks"].items():
        assert r["raw_pickle"] != "still open", task  # not a protocol the server speaks
        for key, got in r.items():
            if key.endswith((" raw", " wire", " wrong token")):
                assert got == "UNAUTHENTICATED", (task, key, got)
            if key.endswith(" task token"):
                if "ParameterServer/Stream" in key and task == "ps:0":  # the stream opens, the method not
                    assert got.startswith("REFUSED") and "for the chief only" in got, (task, key, got)
                elif "ParameterServer/Stream" in key:  # a worker serves no ps stream
                    assert got == "UNIMPLEMENTED", (task, key, got)
                else:
                    assert got == "PERMISSION_DENIED", (task, key, got)


def test_huge_length_claims_allocate_nothing_and_are_rejected(attacked):
    for task, r in attacked["attacks"].items():
        assert r["raw_huge_length"] != "still open", task
        for key in ("grpc_huge_claim", "grpc_huge_claim_authenticated", "grpc_huge_claim_stream",
                    "grpc_huge_claim_stream_authenticated"):
            assert r[key].startswith("rejected"), (task, key, r[key])
    for task, growth in attacked["rss_growth"].items():
        assert growth < 64 << 20, (task, growth)  # the claims were 256 MiB and 2 GiB
    assert attacked["oversized"] == "RESOURCE_EXHAUSTED"


def test_job_keeps_training_and_binds_only_its_own_address(attacked):
    assert attacked["weight"] == -4.0  # 4 steps, each applied once
    for task, addresses in attacked["listening"].items():
        # The harness hosts the rendezvous store as torchrun's agent does, so the chief may listen on nothing;
        # the store a chief hosts itself binds its own address only (the test below).
        assert (addresses or task == "chief") and all(a == "127.0.0.1" for a in addresses), (task, addresses)
    assert "not signed" in attacked["tampered"] and "worker:0" in attacked["tampered"]


# ---- the pieces on their own (fast, in this process) ---------------------------------------------------
def test_a_store_the_chief_hosts_listens_on_its_own_address_only():
    from torchstrategies.parameter_server.rpc.rendezvous import connect_store

    store = connect_store("127.0.0.1", 0, True, 1, 10.0)  # port 0: bound by the listening socket itself
    listening = {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process(os.getpid()).net_connections(kind="tcp")
                 if c.status == "LISTEN" and c.laddr.port == store.port}
    assert listening == {"127.0.0.1"}


def test_wire_rejects_inconsistent_lengths_before_allocating():
    ok = wire.encode(
        {"keys": ["1/0"], "blob": b"\x00\x01"}, [torch.arange(6, dtype=torch.float32).reshape(2, 3)]
    )
    header, tensors = wire.decode(ok)
    assert header == {"keys": ["1/0"], "blob": b"\x00\x01"} and tensors[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    bad_claim = wire.encode({})[:-2] + b"}"  # sanity: truncated header JSON
    with pytest.raises(wire.WireError):
        wire.decode(bad_claim)
    huge = json.dumps({"_blobs": [], "_tensors": [["float32", [1 << 40]]]}).encode()
    with pytest.raises(wire.WireError, match="do not match"):
        wire.decode(b"TSPS\x01\x00\x00\x00" + len(huge).to_bytes(4, "little") + huge)
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(b"TSPS\x01\x00\x00\x00" + (1 << 31).to_bytes(4, "little"))
    with pytest.raises(wire.WireError, match="version"):
        wire.decode(b"TSPS\x09\x00\x00\x00" + b"\x00" * 4)
    with pytest.raises(wire.WireError, match="bad tensor"):
        h = json.dumps({"_tensors": [["object", [1]]]}).encode()
        wire.decode(b"TSPS\x01\x00\x00\x00" + len(h).to_bytes(4, "little") + h)


def test_job_auth_signatures_and_missing_credentials(monkeypatch):
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", SECRET)
    auth = JobAuth.from_env()
    signed = auth.sign("k", "127.0.0.1:5|gen|1")
    assert auth.verify("k", signed) == "127.0.0.1:5|gen|1"
    with pytest.raises(ValueError, match="not signed"):
        auth.verify("other-key", signed)  # an entry moved to another task's key
    with pytest.raises(ValueError, match="not signed"):
        auth.verify("k", "127.0.0.1:6|gen|1|" + signed.rsplit("|", 1)[1])
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        JobAuth.from_env()
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET")
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="TORCHSTRATEGIES_PS_SECRET"):
        JobAuth.from_env()


def test_a_secret_file_other_users_can_read_is_used_with_a_warning_naming_it_and_the_fix(monkeypatch, tmp_path):
    import warnings

    path = tmp_path / "ps_secret"
    path.write_text(SECRET + "\n")
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET", raising=False)
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET_FILE", str(path))
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        with pytest.warns(UserWarning, match="accessible to other users") as caught:
            auth = JobAuth.from_env()
        assert str(path) in str(caught[0].message) and f"chmod 600 {path}" in str(caught[0].message)
        assert auth.secret == SECRET.encode()
    path.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a private file: no warning
        assert JobAuth.from_env().secret == SECRET.encode()


def test_handshake_proves_the_secret_and_the_instance_and_credentials_are_single_use():
    from torchstrategies.parameter_server.rpc.session import (
        AuthError,
        SessionTable,
        client_hello,
        client_session,
    )

    secret = SECRET.encode()
    table = SessionTable(secret, "worker:1|new", max_pending=4)
    hello, nonce = client_hello("chief")
    reply = table.handshake(hello)
    assert len(reply) == 80 and nonce.hex() not in reply.hex()
    with pytest.raises(AuthError, match="did not prove"):  # an older instance, another task, another job
        client_session(secret, "worker:1|old", "chief", nonce, reply)
    with pytest.raises(AuthError, match="did not prove"):
        client_session(secret, "worker:0|new", "chief", nonce, reply)
    with pytest.raises(AuthError, match="did not prove"):
        client_session(b"another job's secret 0123456789", "worker:1|new", "chief", nonce, reply)
    with pytest.raises(AuthError, match="did not prove"):
        client_session(secret, "worker:1|new", "task", nonce, reply)  # the role is bound too
    for bad in (None, "", "chief", "root." + "0" * 64, "chief." + "0" * 63, "chief." + "0" * 64 + "\n"):
        with pytest.raises(AuthError, match="handshake"):
            table.handshake(bad)
    client = client_session(secret, "worker:1|new", "chief", nonce, reply)
    path = "/torchstrategies.ps.v1.Worker/Exec"
    credential = client.call_credential(path)
    assert table.check_call("/torchstrategies.ps.v1.Worker/Setup", credential) is None  # bound to the method
    server = table.check_call(path, credential)
    assert server is not None and server.role == "chief"
    assert table.check_call(path, credential) is None  # used once
    # Messages: the MAC covers the frame's sequence number and the covered bytes; each is accepted once.
    seq = client.next_seq()
    message = wire.encode({"op": "exec", "closure": b"x"}, [torch.ones(2)], seal=client.sealer(seq))
    assert server.open(message) == (seq, len(message) - 48 - 8)
    with pytest.raises(AuthError, match="replayed"):
        server.open(message)
    tampered = bytearray(wire.encode({"op": "exec", "closure": b"y"}, seal=client.sealer(client.next_seq())))
    tampered[-2] ^= 1
    with pytest.raises(AuthError, match="not authenticated"):
        server.open(bytes(tampered))
    with pytest.raises(AuthError, match="no.*authentication frame"):
        server.open(wire.encode({"op": "exec"}))
    reply_to = client.next_seq()
    answer = wire.encode({"ok": True}, seal=server.sealer(reply_to, reply=True))
    assert client.open(answer, reply_to=reply_to)[0] == reply_to
    with pytest.raises(AuthError, match="arrived for request"):
        client.open(answer, reply_to=reply_to + 1)  # a reply to another request
    with pytest.raises(AuthError, match="not authenticated"):
        server.open(answer)  # a reply is not a request
    # Strangers' handshakes only push out other pending sessions, never a proven one.
    for _ in range(10):
        table.handshake(client_hello("task")[0])
    assert table.check_call(path, client.call_credential(path)) is server


def test_replay_window_accepts_each_sequence_number_once_in_any_order():
    from torchstrategies.parameter_server.rpc.session import WINDOW, Session

    s = Session(b"i" * 16, b"k" * 32, "task")
    assert [s.accept(n) for n in (5, 3, 5, 3, 4, 1, 2, 0, -1)] == [True, True, False, False, True, True, True,
                                                                  False, False]
    assert s.accept(5 + WINDOW) and not s.accept(5)  # fell out of the window: refused, never re-accepted
    assert s.accept(6) and not s.accept(6)  # still inside the window
    assert s.accept(10 * WINDOW) and not s.accept(10 * WINDOW - WINDOW) and s.accept(10 * WINDOW - 1)


@pytest.mark.timeout(60)
def test_rendezvous_refuses_an_entry_older_than_the_tasks_counter_or_one_already_read():
    import datetime

    import torch.distributed as dist

    from torchstrategies.errors import UnavailableError
    from torchstrategies.parameter_server.rpc.rendezvous import EntryReader, entry_key, publish

    auth = JobAuth(SECRET.encode())
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    reader = EntryReader(store, auth)
    first = publish(store, auth, "worker", 1, "127.0.0.1:1000", "a")
    assert reader.read("worker", 1) == first and first.seq == 1
    old = store.get(entry_key("worker", 1))
    second = publish(store, auth, "worker", 1, "127.0.0.1:2000", "b")  # worker:1 restarted
    store.set(entry_key("worker", 1), old)                             # a stranger puts the old entry back
    with pytest.raises(UnavailableError, match="worker:1.*stale"):
        reader.read("worker", 1)
    store.set(entry_key("worker", 1), auth.sign(entry_key("worker", 1), "127.0.0.1:2000|b|2"))
    assert reader.read("worker", 1) == second
    store.set(entry_key("worker", 1), old)
    store.set(f"{entry_key('worker', 1).replace('/addr/', '/seq/')}", "1")   # ... and winds the counter back
    with pytest.raises(UnavailableError, match="stale"):
        reader.read("worker", 1)                                       # the chief has read entry 2 already
    store.set(entry_key("worker", 1), "127.0.0.1:9|b|3")
    with pytest.raises(UnavailableError, match="not signed"):
        reader.read("worker", 1)


def _certs(d, name: str) -> dict[str, str]:
    """A CA and one certificate it signed for 127.0.0.1 (openssl CLI), under ``d/name``."""
    os.makedirs(os.path.join(d, name))
    p = {k: os.path.join(d, name, k) for k in ("ca.key", "ca.pem", "t.key", "t.csr", "t.pem", "ext")}
    with open(p["ext"], "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cmd in (
        f"req -x509 -newkey rsa:2048 -nodes -keyout {p['ca.key']} -out {p['ca.pem']} -days 1 "
        f"-subj /CN={name}-ca",
        f"req -newkey rsa:2048 -nodes -keyout {p['t.key']} -out {p['t.csr']} -subj /CN=localhost",
        f"x509 -req -in {p['t.csr']} -CA {p['ca.pem']} -CAkey {p['ca.key']} -CAcreateserial "
        f"-out {p['t.pem']} -days 1 -extfile {p['ext']}",
    ):
        subprocess.run(["openssl", *cmd.split()], check=True, capture_output=True, timeout=60)
    return {"TORCHSTRATEGIES_PS_TLS_CERT": p["t.pem"], "TORCHSTRATEGIES_PS_TLS_KEY": p["t.key"],
            "TORCHSTRATEGIES_PS_TLS_CA": p["ca.pem"]}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not any(os.access(os.path.join(d, "openssl"), os.X_OK)
                            for d in os.environ.get("PATH", "").split(os.pathsep)), reason="needs openssl")
def test_mutual_tls_admits_the_jobs_certificates_only(tmp_path, monkeypatch):
    import datetime

    import torch.distributed as dist

    from torchstrategies.errors import UnavailableError
    from torchstrategies.parameter_server import Server
    from torchstrategies.parameter_server.rpc.auth import CHIEF
    from torchstrategies.parameter_server.rpc.client import RpcClient
    from torchstrategies.parameter_server.rpc.rendezvous import store_prefix

    job, stranger = _certs(str(tmp_path), "job"), _certs(str(tmp_path), "stranger")
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET", raising=False)
    for k, v in job.items():
        monkeypatch.setenv(k, v)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    port = store.port  # bound by the store itself: no other process can take it in between
    spec = {"chief": [f"127.0.0.1:{port}"], "ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    resolver = ts.cluster_resolver.SimpleClusterResolver(spec, task_type="ps", task_id=0)
    server = Server(resolver, timeout=5, lease_timeout=30)
    address, instance = store.get(f"{store_prefix()}/addr/ps/0").decode().split("|")[:2]
    chief = RpcClient(address, "ps:0", 5.0, JobAuth.from_env(), CHIEF, instance=instance, hello={"op": "hello"})
    assert chief.call({"op": "stats"})[0]["pushes"] == 0          # the job's certificate gets in
    for k, v in stranger.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UnavailableError):                          # another CA's certificate does not
        RpcClient(address, "ps:0", 2.0, JobAuth.from_env(), CHIEF, instance=instance, hello={"op": "hello"})
    for k in stranger:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", SECRET)
    with pytest.raises(UnavailableError):                          # nor does plaintext with a secret
        RpcClient(address, "ps:0", 2.0, JobAuth.from_env(), CHIEF, instance=instance, hello={"op": "hello"})
    chief.call({"op": "shutdown"})
    server.join()
    chief.close()
