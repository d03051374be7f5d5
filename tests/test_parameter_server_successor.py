"""Issue 47, item 7: ONE path looks for a worker that was lost, the strategy's heartbeat loop
(``WorkerLink.find_successor``); the coordinator only waits for the instance the link moved to.

Tested with no ClusterCoordinator at all, so nothing else can do the heartbeat path's work: of two workers,
worker:1 is killed (SIGKILL) and its launcher starts a new instance only after several heartbeat intervals,
so the first looks find nothing and the loop must keep looking for THAT worker. The new instance's lease on
the chief is kept by the heartbeats alone (the chief waits longer than the lease), and every task exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from harness import run_ranks

import torchstrategies as ts

SECRET = "test-job-secret-0123456789abcdef"
TASK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_task.py")
LEASE = 4.0             # the worker's lease on the chief, seconds
HEARTBEAT = 0.5         # the chief's heartbeat interval
RESTART_DELAY = 3.0     # the launcher's pause before the new instance: several looks find nothing first


def _pid(pid_file: str, other_than: int = 0, limit: float = 60.0) -> int:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if os.path.exists(pid_file):
            text = open(pid_file).read().strip()
            if text and int(text) != other_than:
                return int(text)
        time.sleep(0.05)
    raise AssertionError(f"no new worker pid in {pid_file}")


def _launcher(pid_file: str) -> list[int]:
    """worker:1's rank: runs the task as a child, writes its pid, restarts it (after a pause) once it is killed."""
    codes: list[int] = []
    root = os.path.dirname(os.path.dirname(TASK))
    env = dict(os.environ, PS_TASK_LEASE=str(LEASE),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    while True:
        child = subprocess.Popen([sys.executable, TASK], env=env, stderr=subprocess.PIPE, text=True)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.replace(pid_file + ".tmp", pid_file)
        _, err = child.communicate(timeout=240)
        codes.append(child.returncode)
        if child.returncode != -signal.SIGKILL:
            if child.returncode != 0:
                raise RuntimeError(f"worker:1 exited with {child.returncode}:\n{err[-3000:]}")
            return codes
        time.sleep(RESTART_DELAY)


def _chief(strategy, pid_file: str) -> dict:
    assert strategy._cluster_coordinator is None  # nothing but the heartbeat loop can look for the worker
    link = strategy._workers[1]
    first = link.latest
    old_pid = _pid(pid_file)
    os.kill(old_pid, signal.SIGKILL)
    end = time.monotonic() + 40.0
    while time.monotonic() < end and (link.latest is first or link.latest.dead.is_set()):
        time.sleep(0.05)
    found = link.latest is not first and not link.latest.dead.is_set()
    successor = link.latest
    new_pid = _pid(pid_file, other_than=old_pid)
    time.sleep(LEASE * 2)  # only the heartbeats keep the new instance's lease
    alive = True
    try:
        os.kill(new_pid, 0)
    except ProcessLookupError:
        alive = False
    return {"found": found, "same_after_lease": link.latest is successor and not successor.dead.is_set(),
            "new_process_alive": alive, "worker0_never_lost": not strategy._workers[0].latest.dead.is_set()
            and strategy._workers[0].latest is not None}


def _cluster(rank, world_size, pid_file):
    resolver = ts.cluster_resolver.TorchrunClusterResolver(num_ps=1)
    if resolver.task_type == "worker" and resolver.task_id == 1:
        return _launcher(pid_file)
    if resolver.task_type != "chief":
        ts.distribute.Server(resolver, timeout=60, lease_timeout=60).join()
        return resolver.task_type
    strategy = ts.ParameterServerStrategy(resolver, timeout=60, heartbeat_interval=HEARTBEAT, heartbeat_timeout=2.0)
    try:
        return _chief(strategy, pid_file)
    finally:
        strategy.shutdown()


@pytest.mark.timeout(200)
def test_the_heartbeat_loop_alone_finds_a_restarted_worker_and_keeps_its_lease(tmp_path):
    chief, ps, worker0, worker1 = run_ranks(_cluster, 4, args=(str(tmp_path / "worker1.pid"),),
                                            init_process_group=False, timeout=180,
                                            env={"TORCHSTRATEGIES_PS_SECRET": SECRET})
    assert chief == {"found": True, "same_after_lease": True, "new_process_alive": True,
                     "worker0_never_lost": True}, chief
    assert (ps, worker0) == ("ps", "worker")
    assert worker1 == [-signal.SIGKILL, 0]  # killed once, then a clean exit on shutdown
