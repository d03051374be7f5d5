"""``make demo`` (``torchstrategies demo``): the examples' result files, the subprocess/torchrun runner, end to
end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import cli_fakes
from torchstrategies.cli import demo

ROOT = Path(__file__).resolve().parents[1]


def test_read_result_reads_what_the_example_wrote(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"strategy": "B", "accuracy": 0.9756, "samples_per_sec": 1234.5}')
    assert demo.read_result(str(path)) == {"strategy": "B", "accuracy": 0.9756, "samples_per_sec": 1234.5}


@pytest.mark.parametrize(
    "text,match",
    [
        (None, "wrote no result"),
        ("{not json}", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"strategy": "A", "accuracy": 0.9}', r"lacks \['samples_per_sec'\]"),
    ],
)
def test_read_result_rejects_a_bad_result_saying_why(tmp_path, text, match):
    path = tmp_path / "r.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=match):
        demo.read_result(str(path))


def _script(path: Path, body: str) -> None:
    path.write_text(textwrap.dedent(body))


GOOD_TORCHRUN = """
    import json, os, sys
    assert os.environ["WORLD_SIZE"] == "2", os.environ["WORLD_SIZE"]
    assert sys.argv[1:3] == ["--fast", "--result-json"], sys.argv
    print("rank", os.environ["RANK"], "training")
    if os.environ["RANK"] == "0":
        print("held-out accuracy 0.9756")
        with open(sys.argv[3], "w") as f:
            json.dump({"strategy": "MultiWorkerMirroredStrategy", "accuracy": 0.9756, "samples_per_sec": 5000.0}, f)
"""
GOOD_PLAIN = """
    import json, os, sys
    assert "RANK" not in os.environ and sys.argv[1:3] == ["--fast", "--result-json"]
    import torchstrategies  # importable from the source tree (PYTHONPATH set by the demo)
    result = {"strategy": "MirroredStrategy", "accuracy": 0.96, "samples_per_sec": 800.0}
    with open(sys.argv[3], "w") as f:
        json.dump(result, f)
"""


@pytest.mark.timeout(180)
def test_demo_runs_examples_reports_missing_ones_and_compares_kernels(monkeypatch, tmp_path, capsys):
    ex = tmp_path / "examples"
    ex.mkdir()
    _script(ex / "multi_worker_digits.py", GOOD_TORCHRUN)
    _script(ex / "mirrored_digits.py", GOOD_PLAIN)  # parameter_server_digits.py is missing on purpose
    monkeypatch.setenv("TORCHSTRATEGIES_EXAMPLES_DIR", str(ex))
    monkeypatch.delenv("RANK", raising=False)
    calls = cli_fakes.install(monkeypatch, "kernels")
    out = tmp_path / "out"
    code = demo.run(fast=True, out_dir=str(out), timeout=120)
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["strategy"], r["accuracy"], r["samples/s"], r["status"]) for r in rows] == [
        ("MultiWorkerMirroredStrategy", 0.9756, 5000.0, "ok"),
        ("MirroredStrategy", 0.96, 800.0, "ok"),
        ("ParameterServerStrategy", "", "", "not available yet"),
    ]
    assert "not available yet" in printed
    # Issue 52: what a person reads has no machine-readable lines, and the summary rounds as the example did.
    assert "RESULT" not in printed and "{" not in printed.split("Summary")[0], printed
    summary_row = next(ln for ln in printed.splitlines() if ln.startswith("MultiWorkerMirroredStrategy"))
    assert "0.9756" in summary_row and "0.98 " not in summary_row, summary_row
    # Then the kernel comparison: tiny sizes in fast mode, its table, advice and a PNG path.
    assert calls["kernels"][0]["ns"] == [2, 8] and calls["kernels"][0]["repeats"] == 3
    assert "accumulate_n" in printed and "Which to use" in printed
    assert (out / "kernels.png").read_bytes()[:4] == b"\x89PNG"
    assert str((out / "kernels.png").resolve()) in printed.replace("\n", "")
    # The kernel plot is stamped like the figures of benchmarks/ (its title holds the record).
    kernels = json.loads((out / "kernels.json").read_text())
    assert set(kernels["meta"]["recorded"]) == {"command", "date_utc", "machine", "load_1min_start", "load_1min_end"}
    assert "UTC on" in kernels["title"] and "1-min load" in kernels["title"]


@pytest.mark.parametrize(
    "body,status_text",
    [
        ("import sys\nprint('partial work')\nsys.exit(3)\n", "exit status 3"),
        ("print('trained, but forgot the result')\n", "wrote no result"),
    ],
)
def test_a_failing_example_is_reported_with_its_output(monkeypatch, tmp_path, body, status_text):
    (tmp_path / "mirrored_digits.py").write_text(body)
    monkeypatch.setenv("TORCHSTRATEGIES_EXAMPLES_DIR", str(tmp_path))
    o = demo.run_example(demo.EXAMPLES[1], fast=True, timeout=3)
    assert o.status == "failed"
    assert status_text in o.detail
    assert ("partial work" in o.detail) or ("forgot" in o.detail)


def test_a_timed_out_example_leaves_no_process_behind(monkeypatch, tmp_path):
    # Like torchrun's workers: a child process the example started must be stopped with it.
    (tmp_path / "mirrored_digits.py").write_text(
        textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("child", child.pid, flush=True)
        time.sleep(120)
    """)
    )
    monkeypatch.setenv("TORCHSTRATEGIES_EXAMPLES_DIR", str(tmp_path))
    o = demo.run_example(demo.EXAMPLES[1], fast=True, timeout=4, echo=False)
    assert o.status == "failed" and "did not finish within 4 s" in o.detail
    pid = int(o.detail.split("child ")[1].split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), f"the example's child {pid} survived the timeout"


def test_a_timeout_shows_where_every_process_of_the_run_stood_and_writes_no_core_file(tmp_path):
    # torchrun-like: the leader waits for a child; which of them hangs is what the output must say.
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        def child_waits_for_a_peer():
            time.sleep(120)
        def leader_waits_for_its_child(child):
            child.wait()
        if sys.argv[1:] == ["child"]:
            child_waits_for_a_peer()
        else:
            child = subprocess.Popen([sys.executable, __file__, "child"])
            print("child", child.pid, flush=True)
            leader_waits_for_its_child(child)
    """))
    code, out, timed_out = demo._run_group([sys.executable, str(script)], 6, str(tmp_path), echo=False, stderr=True)
    assert timed_out and code != 0
    assert "in child_waits_for_a_peer" in out and "in leader_waits_for_its_child" in out, out
    assert out.index("child_waits_for_a_peer") < out.index("leader_waits_for_its_child")  # the leader last
    assert not _alive(int(out.split("child ")[1].split()[0]))
    assert [p.name for p in tmp_path.iterdir()] == ["hangs.py"]  # no core file


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except FileNotFoundError:
        return False


def test_demo_exit_status_is_one_when_an_example_fails(monkeypatch, tmp_path):
    ex = tmp_path / "examples"
    ex.mkdir()
    (ex / "mirrored_digits.py").write_text("raise SystemExit(2)\n")
    monkeypatch.setenv("TORCHSTRATEGIES_EXAMPLES_DIR", str(ex))
    cli_fakes.hide(monkeypatch, "kernels")
    assert demo.run(fast=True, out_dir=str(tmp_path / "o"), timeout=60) == 1


@pytest.mark.timeout(400)
def test_make_demo_fast_end_to_end(tmp_path):
    """What `make demo` runs, with --fast, on this build: every example present must succeed."""
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "torchstrategies", "demo", "--fast", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert len(rows) == len(demo.EXAMPLES)
    for ex, row in zip(demo.EXAMPLES, rows, strict=True):
        if (ROOT / "examples" / ex.script).is_file():
            assert row["status"] == "ok", row
            assert 0.0 <= row["accuracy"] <= 1.0 and row["samples/s"] > 0
        else:
            assert row["status"] == "not available yet"
    if (ROOT / "torchstrategies" / "bench" / "kernels.py").is_file():
        assert (out / "kernels.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "not available in this build: torchstrategies.bench.kernels" in p.stdout
