"""The TensorFlow rows of ``torchstrategies bench train --tf-python PATH``: a client for ``tf_mirrored.py``.

TensorFlow is not a dependency of this project. The user names a Python that has it (``--tf-python`` or
the environment variable ``TORCHSTRATEGIES_TF_PYTHON``); :class:`TFBaseline` starts
``PATH .../bench/tf_mirrored.py`` once, waits for its ``ready`` line, then asks it for one timed round per
row between the torch rounds, so TF's rows and ours share the machine's state (the interleaving the
in-process rows use among themselves). See ``tf_mirrored.py`` for the protocol.

Example:
    >>> with TFBaseline("/path/to/tf-venv/bin/python", replicas=2, threads=1) as tf:   # doctest: +SKIP
    ...     tf.seconds_per_step("mirrored", steps=20, warmup=3)
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["TFBaseline", "TFBaselineError", "SCRIPT", "ENV_VAR", "ROWS", "READY_TIMEOUT_S", "ROUND_TIMEOUT_S"]

SCRIPT = Path(__file__).with_name("tf_mirrored.py")
ENV_VAR = "TORCHSTRATEGIES_TF_PYTHON"
ROWS = ("mirrored", "one_device")
READY_TIMEOUT_S = 600.0  # importing TF and tracing two tf.functions on a loaded 2-core VM
ROUND_TIMEOUT_S = 600.0


class TFBaselineError(RuntimeError):
    """The TF process could not start, answered out of protocol, died or did not answer in time."""


class TFBaseline:
    """One ``tf_mirrored.py`` process: MirroredStrategy(replicas) and OneDeviceStrategy of the same MLP.

    Args:
        python: a Python executable that can ``import tensorflow``.
        replicas: logical CPU devices of TF's MirroredStrategy.
        threads: the threads TF may compute on at once, the same as the torch rows
            (``torch.set_num_threads``), so both use the same number of cores: TF runs ``inter_op``
            inter-op threads (its replicas run side by side) of ``max(1, threads // inter_op)`` intra-op
            threads each.
        inter_op: TF inter-op threads; None gives ``min(threads, replicas)`` (1 thread: 1 x 1, as torch's
            one thread; 2 threads and 2 replicas: 2 inter-op x 1 intra-op against torch's 2 intra-op).
        sizes / batch / lr: the MLP widths, global batch and SGD learning rate.
        ready_timeout / round_timeout: seconds to wait for ``ready`` and for each round.

    Raises:
        TFBaselineError: (from ``start``) ``python`` is not executable, has no TensorFlow, or the script
            failed; the message names the Python and ends with its stderr.
    """

    def __init__(
        self,
        python: str,
        replicas: int = 2,
        threads: int = 1,
        inter_op: int | None = None,
        sizes: tuple[int, ...] = (784, 1024, 1024, 10),
        batch: int = 64,
        lr: float = 0.01,
        ready_timeout: float = READY_TIMEOUT_S,
        round_timeout: float = ROUND_TIMEOUT_S,
    ) -> None:
        if not python:
            raise ValueError(f"tf_python must name a Python executable, got {python!r}")
        self.python = python
        self.inter_op = inter_op if inter_op is not None else min(threads, replicas)
        self.intra_op = max(1, threads // self.inter_op)
        self.args = [
            f"--replicas={replicas}", f"--threads={self.intra_op}", f"--inter-op={self.inter_op}",
            f"--sizes={','.join(map(str, sizes))}", f"--batch={batch}", f"--lr={lr}",
        ]
        self.ready_timeout = ready_timeout
        self.round_timeout = round_timeout
        self.info: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: IO[str] | None = None

    def start(self) -> dict[str, Any]:
        """Starts the process and waits for its ``ready`` line; returns it (TF version, devices, threads)."""
        self._stderr = tempfile.TemporaryFile("w+")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        env.pop("PYTHONPATH", None)  # the TF venv must not pick up this project's packages
        try:
            self._proc = subprocess.Popen(
                [self.python, str(SCRIPT), *self.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._stderr, text=True, env=env,
            )
        except OSError as e:
            raise TFBaselineError(f"cannot start the TF baseline with python {self.python!r}: {e}") from e
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()
        ready = self._answer(self.ready_timeout, "the ready line")
        if ready.get("ready") is not True:
            raise self._fail(f"expected the ready line, got {ready!r}")
        self.info = ready
        return ready

    def seconds_per_step(self, row: str, steps: int, warmup: int) -> float:
        """One timed round of ``row`` ("mirrored" or "one_device"): seconds per step."""
        if row not in ROWS:
            raise ValueError(f"TF baseline row must be one of {ROWS}, got {row!r}")
        if self._proc is None or self._proc.stdin is None:
            raise TFBaselineError("the TF baseline is not started")
        try:
            self._proc.stdin.write(json.dumps({"row": row, "steps": steps, "warmup": warmup}) + "\n")
            self._proc.stdin.flush()
        except OSError as e:
            raise self._fail(f"cannot send a request ({e})") from e
        answer = self._answer(self.round_timeout, f"the {row} round")
        t = answer.get("seconds_per_step")
        if answer.get("row") != row or not isinstance(t, (int, float)) or not t > 0:
            raise self._fail(f"expected a {row} timing, got {answer!r}")
        return float(t)

    def close(self) -> None:
        """Ends the process (closes its stdin; kills it if it does not exit within 10 s)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> TFBaseline:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _read(self, stream: IO[str] | None) -> None:
        if stream is not None:
            for line in stream:
                self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        """The next JSON object line (other stdout lines are skipped: libraries may print)."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise self._fail(f"no answer for {what} within {timeout:.0f} s") from None
            if line is None:
                raise self._fail(f"the process ended before {what}")
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                if "error" in obj:
                    raise self._fail(f"it reported: {obj['error']}")
                return obj

    def _fail(self, problem: str) -> TFBaselineError:
        tail = ""
        code = None
        if self._proc is not None:
            try:  # an exiting process keeps its own exit code; a stuck one is killed
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            code = self._proc.wait()
        if self._stderr is not None:
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:]
        self.close()
        return TFBaselineError(
            f"TF baseline ({self.python} {SCRIPT.name}): {problem}; exit code {code}; stderr tail:\n{tail}"
        )
