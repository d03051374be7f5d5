"""Issue 27: nothing a stranger records or replays lets it call anything (chief, 1 ps, 1 worker on 127.0.0.1).

(a) A replayed older store entry: worker:0 restarts; an outside process without the secret puts worker:0's
entry from before the restart back into the rendezvous store and listens on its old address, relaying every
call to the new worker:0 and recording it. The chief refuses the entry; made to connect there anyway, it
sends nothing but its handshake (which the relay cannot answer as the old instance), and nothing the
attacker recorded opens a call.

(b) A passive capture: every connection of the job goes through a CONNECT proxy that records what each
client sends (the bytes a sniffer on a network without TLS sees). An outside process replays each recorded
connection byte for byte, 50 times: no push, assign_add or exec applies again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from _ps_bodies import counter_model
from harness import run_ranks

import torchstrategies as ts

SECRET = "test-job-secret-0123456789abcdef"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACKS = os.path.join(ROOT, "tests", "ps_replay_attacks.py")
_SERVER: dict = {}


def _stranger_env() -> dict[str, str]:
    """The environment of a process without the job's secret (and not behind the tap)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TORCHSTRATEGIES_PS_SECRET")
            and k.lower() != "grpc_proxy"}


def _result(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, text[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _serve(resolver):
    """A ps, or a worker whose server may stop and come back as a new instance (a restarted task)."""
    _SERVER["n"] = 0
    while True:
        _SERVER["n"] += 1
        server = ts.distribute.Server(resolver, timeout=60, lease_timeout=30)
        _SERVER["server"] = server
        server.join()
        if server._shutdown_requested or resolver.task_type == "ps":
            return resolver.task_type


def _restart_once():
    """Run on the worker: the first time, stops its server (the task restarts) and never returns."""
    if _SERVER["n"] == 1:
        threading.Thread(target=_SERVER["server"].stop, daemon=True).start()
        time.sleep(10)
    return _SERVER["n"]


# ---- (a) a replayed older entry, and a relay on the old address ------------------------------------------
def _stale_entry_attack(strategy, marker):
    import datetime

    import torch.distributed as dist

    from torchstrategies.errors import UnavailableError
    from torchstrategies.parameter_server.rpc.rendezvous import entry_key

    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    model, _, step = counter_model(strategy)
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    r = strategy._cluster_resolver
    store = dist.TCPStore(r.master_addr, r.master_port, None, False, datetime.timedelta(seconds=10))
    key = entry_key("worker", 0)
    old_entry = store.get(key).decode()  # anyone who reaches the store can read it
    old_address, old_instance = old_entry.split("|")[:2]
    assert coordinator.schedule(_restart_once).fetch() == 2  # ran on the restarted worker:0
    new_address = store.get(key).decode().split("|")[0]
    ps_address = strategy._ps_addresses[0]
    spec = {"root": ROOT, "store": [r.master_addr, r.master_port], "key": key, "old_entry": old_entry,
            "listen": old_address, "relay_to": new_address, "targets": [new_address, ps_address],
            "marker": marker}
    attacker = subprocess.Popen([sys.executable, ATTACKS, "stale", json.dumps(spec)], env=_stranger_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = attacker.stdout.readline()
        assert ready.strip() == "READY", (ready, attacker.stderr.read()[-3000:] if attacker.poll() else "")
        try:  # what the chief's reconnect paths do: read worker:0's entry
            strategy._server_address("worker", 0)
            stale = "accepted"
        except UnavailableError as exc:
            stale = str(exc)
        try:  # and as if it had accepted it: connect to the old address
            strategy._connect_worker(0, old_address, old_instance).close()
            forced = "connected"
        except UnavailableError as exc:
            forced = str(exc)
        out, err = attacker.communicate("GO\n", timeout=150)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert attacker.returncode == 0, err[-3000:]
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    return {"stale": stale, "forced": forced, "attack": _result(out),
            "weight": float(model.weight.detach().reshape(()))}


def _cluster(rank, world_size, body, *args):
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type != "chief":
        return _serve(resolver)
    strategy = ts.ParameterServerStrategy(resolver, timeout=20)
    try:
        return body(strategy, *args)
    finally:
        strategy.shutdown()


@pytest.mark.timeout(300)
def test_a_replayed_older_entry_is_refused_and_its_listener_gets_nothing_usable(tmp_path):
    marker = str(tmp_path / "pwned")
    env = {"TORCHSTRATEGIES_PS_SECRET": SECRET}
    results = run_ranks(_cluster, 3, args=(_stale_entry_attack, marker), init_process_group=False,
                        timeout=240, env=env)
    got = results[0]
    assert "stale" in got["stale"] and "worker:0" in got["stale"], got["stale"]
    assert "did not prove" in got["forced"], got["forced"]
    attack = got["attack"]
    # The chief sent the old address nothing but its handshake: no credential, no request.
    assert attack["relayed"] and {c["method"] for c in attack["relayed"]} == {"/torchstrategies.ps.v1.Auth/Handshake"}
    assert all(not any(k == "x-ts-auth" for k, _ in c["metadata"]) for c in attack["relayed"])
    assert attack["tried"] and set(attack["tried"].values()) == {"UNAUTHENTICATED"}, attack["tried"]
    assert attack["marker_exists"] is False and not os.path.exists(marker)
    assert got["weight"] == -4.0  # the job kept training: 4 steps, each applied once


# ---- (b) a passive capture, replayed --------------------------------------------------------------------
def _capture_then_replay(strategy, capture, runs):
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    model, _, step = counter_model(strategy)
    with strategy.scope():
        counter = ts.Variable(torch.tensor(0.0), name="counter")

    def increment():  # a push, an assign_add, and a mark of each run, on the worker
        step()
        counter.assign_add(1.0)
        with open(runs, "a") as f:
            f.write("x")

    for _ in range(3):
        coordinator.schedule(increment)
    coordinator.join()

    def state():
        with open(runs) as f:
            n_runs = len(f.read())
        stats = strategy.ps_stats(0)
        return {"version": stats["version"], "pushes": stats["pushes"], "runs": n_runs,
                "weight": float(model.weight.detach().reshape(())), "counter": float(counter)}

    before = state()
    spec = {"root": ROOT, "dir": capture, "times": 50}
    proc = subprocess.run([sys.executable, ATTACKS, "replay", json.dumps(spec)], env=_stranger_env(),
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    time.sleep(1.0)  # a replayed request the servers accepted would have been applied by now
    return {"before": before, "after": state(), "replay": _result(proc.stdout),
            "targets": {"ps:0": strategy._ps_addresses[0], "worker:0": strategy._workers[0].latest.address}}


@pytest.mark.timeout(300)
def test_a_passive_capture_replayed_fifty_times_applies_nothing(tmp_path):
    capture = tmp_path / "capture"
    capture.mkdir()
    runs = str(tmp_path / "runs")
    open(runs, "w").close()
    tap = subprocess.Popen([sys.executable, ATTACKS, "tap", json.dumps({"dir": str(capture)})],
                           env=_stranger_env(), stdout=subprocess.PIPE, text=True)
    try:
        port = int(tap.stdout.readline().split()[1])
        env = {"TORCHSTRATEGIES_PS_SECRET": SECRET, "grpc_proxy": f"http://127.0.0.1:{port}",
               "no_grpc_proxy": "", "no_proxy": "", "NO_PROXY": ""}
        results = run_ranks(_cluster, 3, args=(_capture_then_replay, str(capture), runs),
                            init_process_group=False, timeout=240, env=env)
    finally:
        tap.kill()
        tap.wait()
    got = results[0]
    before, after = got["before"], got["after"]
    assert before == {"version": before["version"], "pushes": 3, "runs": 3, "weight": -3.0, "counter": 3.0}
    assert after == before  # no replayed push, assign_add or exec applied
    replayed = got["replay"]["connections"].values()
    targets = {c["target"] for c in replayed if c["bytes"]}
    assert set(got["targets"].values()) <= targets  # the chief's and the worker's traffic was captured
    assert all(len(c["answered"]) == 50 for c in replayed if c["bytes"])
