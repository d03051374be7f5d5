"""Runs a benchmark's torchrun job, turning its ``PROGRESS`` lines into a progress bar.

:func:`run_job` is the one launch of ``bench allreduce``, ``bench train`` and ``bench train-ps``: torchrun on
a worker module that writes its timings as JSON (rank 0), read back here; :func:`job_env` is the job's
environment and :func:`worker_spec` the worker's side of a spec passed as ``--spec JSON``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["run_torchrun", "run_job", "job_env", "worker_spec", "environment"]


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Sets ``values`` in ``os.environ`` inside; puts back what was there (or nothing) when left. For the knobs
    a strategy reads when it is made, so they tune one row's strategy and not the rows after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def job_env(**extra: str) -> dict[str, str]:
    """This environment for a torchrun job: ``OMP_NUM_THREADS`` 1 unless set, a ``PYTHONPATH`` that finds
    this package, the current directory and this interpreter's paths, and ``extra``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([root, os.getcwd(), *sys.path])
    return env


def run_job(module: str, nproc: int, args: list[str], env: dict[str, str], *, total: int, desc: str,
            progress: bool, timeout: float | None = None) -> dict[str, Any]:
    """Runs ``torchrun --standalone --nproc_per_node nproc -m module *args --json OUT`` (see
    :func:`run_torchrun`) and returns the JSON object the job wrote to OUT.

    Raises:
        RuntimeError: the job failed, timed out or wrote no results.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", module, *args, "--json", out]
        run_torchrun(cmd, env, total=total, desc=desc, progress=progress, timeout=timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"{desc}: the job wrote no results: {' '.join(cmd)}")
        with open(out) as f:
            data: dict[str, Any] = json.load(f)
    return data


def worker_spec(argv: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """In a worker that :func:`run_job` started with ``["--spec", json.dumps(spec)]``: (spec, output path)."""
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    return json.loads(a.spec), a.json


def run_torchrun(cmd: list[str], env: dict[str, str], *, total: int, desc: str, progress: bool,
                 timeout: float | None = None) -> None:
    """Runs ``cmd``; each stdout line starting with ``PROGRESS`` advances a tqdm bar of ``total`` steps.

    stderr goes to a temporary file rather than a pipe, so a chatty job cannot fill the pipe and block
    while stdout is being read. With ``timeout``, a job still running after that many seconds gets SIGTERM
    (torchrun passes it on to its workers), then SIGKILL 10 s later.

    Raises:
        RuntimeError: the job exited non-zero or timed out (the message ends with the tail of its stderr).
    """
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

        timer = threading.Timer(timeout, stop) if timeout is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, file=sys.stderr)
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PROGRESS") and bar is not None:
                bar.update(1)
                bar.set_postfix_str(line.split()[-1])
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
        if bar is not None:
            bar.close()
        if expired.is_set():
            err.seek(0)
            raise RuntimeError(f"{desc}: torchrun did not finish within {timeout:g} s:\n{err.read()[-4000:]}")
        if rc != 0:
            err.seek(0)
            raise RuntimeError(f"{desc}: torchrun exited with {rc}:\n{err.read()[-4000:]}")
