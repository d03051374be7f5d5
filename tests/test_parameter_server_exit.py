"""Issue 40: every task of a parameter-server job exits 0 on a normal shutdown, with none of the library's
threads left running at interpreter exit, run after run.

Each run starts a small job (``ps_small_job.py``: chief, 1 ps, 1 worker, one process each, as a launcher
would) whose chief returns without calling ``shutdown()`` (the strategy shuts the cluster down at exit);
every task prints the threads still alive after the library's exit handler ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import Rendezvous

SECRET = "test-job-secret-0123456789abcdef"
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ps_small_job.py")
ROOT = os.path.dirname(os.path.dirname(JOB))   # the checkout: the tasks import this tree's package
RUNS = int(os.environ.get("PS_EXIT_RUNS", "5"))  # more with PS_EXIT_RUNS=N


def _run_job() -> list[tuple[int, list[str], str]]:
    """One job: ``(exit code, threads left at exit, output)`` per task, chief first."""
    rdzv = Rendezvous()  # hosted here, as torchrun's agent hosts it: the store binds its own port
    procs = []
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="3",
                   GROUP_RANK="0", OMP_NUM_THREADS="1", TORCHSTRATEGIES_PS_SECRET=SECRET, **rdzv.env(),
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=120)
            threads = [json.loads(line[len("THREADS "):]) for line in text.splitlines() if line.startswith("THREADS ")]
            out.append((p.returncode, threads[-1] if threads else None, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        rdzv.close()
    return out


@pytest.mark.timeout(900)
def test_a_small_job_run_five_times_ends_with_every_task_exiting_zero_and_no_thread_left():
    for run in range(RUNS):
        tasks = _run_job()
        for (code, threads, text), name in zip(tasks, ("chief", "ps:0", "worker:0"), strict=True):
            assert code == 0, f"run {run}: {name} exited {code}:\n{text[-3000:]}"
            assert threads == [], f"run {run}: {name} left threads running at exit: {threads}\n{text[-2000:]}"
        assert "RESULT -3.0" in tasks[0][2], tasks[0][2][-2000:]
