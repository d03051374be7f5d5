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
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.strategies.parameter_server import wire
from torchstrategies.strategies.parameter_server.auth import JobAuth

SECRET = "test-job-secret-0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 4 << 20


def _listening(pid: int) -> list[str]:
    """The local addresses a process listens on (an IPv4-mapped IPv6 socket counts as its IPv4 address)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == "LISTEN"})


def _chief(strategy, pid_dir, marker):
    import datetime

    import grpc
    import torch.distributed as dist

    from torchstrategies.errors import UnavailableError
    from torchstrategies.strategies.parameter_server.auth import CHIEF, TASK

    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)

    def step():
        opt.zero_grad()
        model(torch.ones(1, 1)).sum().backward()
        opt.step()

    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    pids = {n: int(open(os.path.join(pid_dir, n)).read()) for n in ("ps0", "worker0")}
    rss_before = {n: psutil.Process(p).memory_info().rss for n, p in pids.items()}
    targets = {"ps:0": strategy._ps_addresses[0], "worker:0": strategy._control[("worker", 0)].address}
    auth = strategy._auth
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHSTRATEGIES_PS_SECRET")}
    spec = {
        "targets": targets,
        "marker": marker,
        "root": ROOT,
        "token": auth.token(CHIEF),
        "task_token": auth.token(TASK),
    }
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
    with grpc.insecure_channel(targets["ps:0"], options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        big = wire.encode({"oid": 1, "entries": []}, [torch.zeros(LIMIT // 4 + 1024)])
        try:
            ch.unary_unary("/torchstrategies.ps.v1.ParameterServer/Push")(
                big, timeout=10, metadata=(("x-ts-auth", auth.token(TASK)),)
            )
            oversized = "OK"
        except grpc.RpcError as exc:
            oversized = exc.code().name
    # A stranger overwrites worker 0's address in the store: the chief refuses the entry.
    key = strategy._key("worker", 0)
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
        ts.strategies.parameter_server.Server(resolver, timeout=60, lease_timeout=30).join()
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
        assert addresses and all(a == "127.0.0.1" for a in addresses), (task, addresses)
    assert "not signed" in attacked["tampered"] and "worker:0" in attacked["tampered"]


# ---- the pieces on their own (fast, in this process) ---------------------------------------------------
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


def test_job_auth_tokens_signatures_and_missing_credentials(monkeypatch):
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", SECRET)
    auth = JobAuth.from_env()
    assert auth.role_of(auth.token("chief")) == "chief" and auth.role_of(auth.token("task")) == "task"
    assert auth.role_of("") is None and auth.role_of("f" * 64) is None
    signed = auth.sign("k", "127.0.0.1:5|gen")
    assert auth.verify("k", signed) == "127.0.0.1:5|gen"
    with pytest.raises(ValueError, match="not signed"):
        auth.verify("other-key", signed)  # an entry moved to another task's key
    with pytest.raises(ValueError, match="not signed"):
        auth.verify("k", "127.0.0.1:6|gen|" + signed.rsplit("|", 1)[1])
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        JobAuth.from_env()
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET")
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="TORCHSTRATEGIES_PS_SECRET"):
        JobAuth.from_env()


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
    from harness import free_port

    from torchstrategies.errors import UnavailableError
    from torchstrategies.strategies.parameter_server import Server
    from torchstrategies.strategies.parameter_server.auth import CHIEF
    from torchstrategies.strategies.parameter_server.transport import RpcClient, store_prefix

    job, stranger = _certs(str(tmp_path), "job"), _certs(str(tmp_path), "stranger")
    monkeypatch.delenv("TORCHSTRATEGIES_PS_SECRET", raising=False)
    for k, v in job.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    spec = {"chief": [f"127.0.0.1:{port}"], "ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    resolver = ts.cluster_resolver.SimpleClusterResolver(spec, task_type="ps", task_id=0)
    server = Server(resolver, timeout=5, lease_timeout=30)
    address = store.get(f"{store_prefix()}/addr/ps/0").decode().split("|")[0]
    chief = RpcClient(address, "ps:0", 5.0, JobAuth.from_env(), CHIEF, hello={"op": "hello"})
    assert chief.call({"op": "stats"})[0]["pushes"] == 0          # the job's certificate gets in
    for k, v in stranger.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UnavailableError):                          # another CA's certificate does not
        RpcClient(address, "ps:0", 2.0, JobAuth.from_env(), CHIEF, hello={"op": "hello"})
    for k in stranger:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TORCHSTRATEGIES_PS_SECRET", SECRET)
    with pytest.raises(UnavailableError):                          # nor does plaintext with a secret
        RpcClient(address, "ps:0", 2.0, JobAuth.from_env(), CHIEF, hello={"op": "hello"})
    chief.call({"op": "shutdown"})
    server.join()
    chief.close()
