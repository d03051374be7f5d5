"""Runs a benchmark's torchrun job, turning its ``PROGRESS`` lines into a progress bar."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading

__all__ = ["run_torchrun"]


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
