"""``make demo`` / ``torchstrategies demo``: the main job, end to end, on this machine.

1. examples/multi_worker_digits.py under torchrun with 2 local workers (MultiWorkerMirroredStrategy),
2. examples/mirrored_digits.py (MirroredStrategy, one process),
3. examples/parameter_server_digits.py under torchrun with 4 processes (chief, 1 ps, 2 workers),

each in its own subprocess, shown as it runs; each writes its result (``--result-json FILE``: strategy,
accuracy, samples/s) to a file the demo reads for the summary table, so no machine-readable line mixes
into what you read. Then the kernel benchmark (``bench kernels``) prints its table and draws a PNG stamped
with the date, the machine and the load (as the figures of benchmarks/ are), with the fastest kernel per
size. An example that is not in this build is reported as "not available yet"; an
example that fails is reported with the tail of its output, and the demo exits with status 1 at the end.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import click
    from rich.console import Console

    from torchstrategies.bench.report import BenchResult

__all__ = ["EXAMPLES", "Example", "Outcome", "read_result", "run_example", "run", "demo", "examples_dir"]


@dataclass(frozen=True)
class Example:
    """One demo step: a script in examples/ and how many processes torchrun starts (0 = plain python)."""

    strategy: str
    launch: str
    script: str
    nproc: int

    @property
    def title(self) -> str:
        return f"{self.strategy} ({self.launch})"


EXAMPLES = (
    Example("MultiWorkerMirroredStrategy", "torchrun x2", "multi_worker_digits.py", 2),
    Example("MirroredStrategy", "1 process", "mirrored_digits.py", 0),
    Example("ParameterServerStrategy", "torchrun x4: chief, ps, 2 workers", "parameter_server_digits.py", 4),
)


@dataclass
class Outcome:
    """What one example run produced."""

    example: Example
    status: str  # "ok", "not available yet", "failed"
    result: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    detail: str = ""


def examples_dir() -> Path:
    """The repository's examples/ (next to the package), or TORCHSTRATEGIES_EXAMPLES_DIR."""
    override = os.environ.get("TORCHSTRATEGIES_EXAMPLES_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2] / "examples"


def read_result(path: str) -> dict[str, Any]:
    """The result an example wrote with ``--result-json path``.

    Raises:
        ValueError: the file is missing or empty, its JSON is invalid, or it lacks accuracy / samples_per_sec.
    """
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if not text.strip():
        raise ValueError("the example wrote no result (--result-json)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"its result is not JSON ({exc}): {text!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"its result must be a JSON object, got {text!r}")
    missing = [k for k in ("accuracy", "samples_per_sec") if k not in data]
    if missing:
        raise ValueError(f"its result lacks {missing}: {text!r}")
    return data


def _command(ex: Example, script: Path, extra: list[str]) -> list[str]:
    if ex.nproc:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ex.nproc}",
            str(script),
            *extra,
        ]
    return [sys.executable, str(script), *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a process that crashes, or is stopped on a timeout, shows its stacks
    from torchstrategies.parameter_server.rpc.auth import with_job_secret

    return with_job_secret(env)       # the ParameterServerStrategy example needs a job secret


def run_example(ex: Example, *, fast: bool, timeout: float, echo: bool = True) -> Outcome:
    """Runs one example in a subprocess: stdout is echoed and kept, stderr (the progress bar) passes
    through. The example runs in its own process group, so a timeout or Ctrl-C stops torchrun's workers
    too, never leaving them behind."""
    script = examples_dir() / ex.script
    if not script.is_file():
        return Outcome(ex, "not available yet", detail=f"{script} is not in this build")
    with tempfile.TemporaryDirectory(prefix="torchstrategies-demo-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        extra = (["--fast"] if fast else []) + ["--result-json", result_path]
        t0 = time.perf_counter()
        code, out, timed_out = _run_group(_command(ex, script, extra), timeout, str(script.parent.parent), echo)
        seconds = time.perf_counter() - t0
        try:
            data: dict[str, Any] | str = read_result(result_path)
        except ValueError as exc:
            data = str(exc)
    if timed_out:
        return Outcome(
            ex,
            "failed",
            seconds=seconds,
            detail=f"did not finish within {timeout:.0f} s (stopped); last output:\n{_tail(out)}",
        )
    if code != 0:
        return Outcome(
            ex, "failed", seconds=seconds, detail=f"exit status {code}; last output:\n{_tail(out)}"
        )
    if isinstance(data, str):
        return Outcome(ex, "failed", seconds=seconds, detail=f"{data}; last output:\n{_tail(out)}")
    return Outcome(ex, "ok", result=data, seconds=seconds)


def _run_group(
    cmd: list[str], timeout: float, cwd: str, echo: bool, stderr: bool = False
) -> tuple[int, str, bool]:
    """Runs ``cmd`` in a new session; returns (exit status, stdout, timed out). ``stderr``: capture it
    with stdout instead of letting it through. On a timeout every process of the session first writes where
    each of its threads stands to stderr (:func:`_show_stacks`), so the output says which process hung where."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if stderr else None,
        text=True,
        env=_env(),
        cwd=cwd,
        start_new_session=True,
        errors="replace",
        preexec_fn=_no_core_files,
    )
    timed_out = threading.Event()

    def on_timeout() -> None:
        timed_out.set()
        _show_stacks(proc)
        _stop_group(proc)

    timer = threading.Timer(timeout, on_timeout)
    timer.daemon = True
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        proc.wait()
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        timer.cancel()
        if proc.stdout is not None:
            proc.stdout.close()
    return proc.returncode, "".join(lines), timed_out.is_set()


def _no_core_files() -> None:
    """In the child before exec (inherited by all it starts): a process aborted by :func:`_show_stacks` writes
    no core file into the working directory."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _show_stacks(proc: subprocess.Popen, wait: float = 2.0) -> None:
    """Every process of ``proc``'s session writes where each of its threads stands, then ends: all are stopped
    first (SIGSTOP: none reacts to another's end, and their outputs do not interleave), then one at a time, the
    leader (torchrun) last, each gets SIGABRT, on which Python's fault handler (on by ``PYTHONFAULTHANDLER``,
    :func:`_env`) writes its stacks to stderr, and is let go on; each is waited for up to ``wait`` seconds."""
    pids = sorted(_session_pids(proc.pid), key=lambda pid: pid == proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGABRT):  # the abort waits, pending, until the process goes on
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        end = time.monotonic() + wait
        while time.monotonic() < end and pid in _session_pids(proc.pid):
            time.sleep(0.05)


def _session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes whose session is ``sid`` (Linux /proc; elsewhere none)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the example's whole process group, SIGKILL after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; make sure no worker of the group survives it.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _tail(text: str, lines: int = 15) -> str:
    if not (text or "").strip():
        return "(nothing on stdout; its stderr, shown above, has the error)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def summary(outcomes: list[Outcome]) -> BenchResult:
    """The summary BenchResult: strategy, accuracy, samples/s, wall time, status."""
    from torchstrategies.bench.report import BenchResult

    res = BenchResult(
        "torchstrategies demo: digits (scikit-learn), held-out accuracy",
        ["strategy", "launch", "accuracy", "samples/s", "wall s", "status"],
        meta={"formats": {"accuracy": ".4f", "samples/s": ".1f", "wall s": ".1f"}},  # as the examples print them
    )
    for o in outcomes:
        res.rows.append(
            {
                "strategy": o.result.get("strategy") or o.example.strategy,
                "launch": o.example.launch,
                "accuracy": o.result.get("accuracy", ""),
                "samples/s": o.result.get("samples_per_sec", ""),
                "wall s": round(o.seconds, 1) if o.status != "not available yet" else "",
                "status": o.status,
            }
        )
    return res


def run(fast: bool = False, out_dir: str = "demo-results", timeout: float | None = None) -> int:
    """Runs the whole demo; returns the exit status (0 = every available step succeeded)."""
    from rich.console import Console

    from torchstrategies.cli._common import module_available
    from torchstrategies.cli.bench_cmds import BENCH_MODULES

    console = Console()
    timeout = timeout or (180.0 if fast else 900.0)
    os.makedirs(out_dir, exist_ok=True)
    outcomes: list[Outcome] = []
    for i, ex in enumerate(EXAMPLES, 1):
        console.rule(f"[{i}/{len(EXAMPLES)}] {ex.title}")
        o = run_example(ex, fast=fast, timeout=timeout)
        if o.status == "failed":
            console.print(f"[red]{ex.script} failed[/red]: {o.detail}", markup=True, highlight=False)
        elif o.status != "ok":
            console.print(f"{ex.script}: {o.status}")
        outcomes.append(o)
    table = summary(outcomes)
    failed = sum(o.status == "failed" for o in outcomes)
    console.rule("Summary")
    table.print(console)
    table.write_json(os.path.join(out_dir, "summary.json"))

    console.rule("Aggregation kernels")
    if not module_available(BENCH_MODULES["kernels"]):
        console.print(f"kernel comparison: not available in this build: {BENCH_MODULES['kernels']}")
    else:
        failed += _kernels(console, fast, out_dir)
    console.print(f"results in {os.path.abspath(out_dir)}")
    return 1 if failed else 0


def _kernels(console: Console, fast: bool, out_dir: str) -> int:
    from torchstrategies.bench.report import stamp
    from torchstrategies.cli._common import emit_result
    from torchstrategies.cli.bench_cmds import run_bench
    from torchstrategies.cli.compare import advice

    # Fast: tiny sizes for the tests. Full: the sizes up to 16M elements, N up to 8, 5 rounds (about
    # a minute on 2 cores; `torchstrategies bench kernels` runs the complete grid).
    if fast:
        opts: dict[str, object] = {"n": (2, 8), "kernel_sizes": (1 << 16, 1 << 20), "repeats": 3}
    else:
        opts = {"n": (2, 4, 8), "kernel_sizes": (1 << 16, 1 << 20, 1 << 24), "repeats": 5}
    explicit = set(opts)
    opts["progress"] = True
    started, load_before = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
    try:
        result, module = run_bench("kernels", opts, explicit)
    except Exception as exc:  # noqa: BLE001 - the demo reports and goes on
        console.print(f"kernel benchmark failed: {type(exc).__name__}: {exc}")
        return 1
    stamp(result, "torchstrategies demo" + (" --fast" if fast else ""), started, load_before)  # on the plot too
    has_plot = getattr(module, "plot", None) is not None
    png = os.path.abspath(os.path.join(out_dir, "kernels.png")) if has_plot else None
    emit_result(result, module, os.path.join(out_dir, "kernels.json"), png, console=console)
    if not has_plot:
        console.print(f"plot: not available in this build: {module.__name__}.plot")
    try:
        advice({"kernels": result}).print(console)
    except ValueError as exc:
        console.print(f"(no advice: {exc})")
    return 0


def demo(ctx: click.Context, fast: bool, out_dir: str, timeout: float | None) -> None:
    """``torchstrategies demo`` (options: ``torchstrategies_cli``): :func:`run`, exiting with its status."""
    code = run(fast=fast, out_dir=out_dir, timeout=timeout)
    if code:
        raise SystemExit(code)
