"""The TF baseline rows of ``torchstrategies bench train --tf-python``, without TensorFlow: a fake "TF python"
speaks tf_mirrored.py's protocol with known timings, so the plumbing (arguments, interleaving, row names,
the 'vs TF Mirrored(2)' column, errors) is checked; speed itself is never asserted."""

from __future__ import annotations

import ast
import json
import py_compile
import sys
from pathlib import Path

import pytest

from torchstrategies.bench import tf_baseline, train_inproc
from torchstrategies.bench.tf_baseline import TFBaseline, TFBaselineError

FAKE = '''#!{python}
import json, sys
with open({log!r}, "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
mode = {mode!r}
if mode == "crash":
    sys.stderr.write("ModuleNotFoundError: No module named 'tensorflow'\\n")
    sys.exit(3)
if mode == "silent":
    sys.stdin.read()
    sys.exit(0)
print("some library chatter on stdout")
print(json.dumps({{"ready": True, "tf": "9.9.9-fake", "rows": ["mirrored", "one_device"],
                  "devices": ["/device:CPU:0", "/device:CPU:1"], "intra_op": 1, "inter_op": 2}}), flush=True)
per_step = {{"mirrored": 0.020, "one_device": 0.010}}
for line in sys.stdin:
    req = json.loads(line)
    with open({log!r}, "a") as log:
        log.write(json.dumps(req) + "\\n")
    if mode == "wrong":
        print(json.dumps({{"error": "no such row"}}), flush=True)
        continue
    print(json.dumps({{"row": req["row"], "seconds_per_step": per_step[req["row"]], "loss": 2.3}}), flush=True)
'''


def _fake(tmp_path: Path, mode: str = "ok") -> tuple[str, Path]:
    log = tmp_path / "log.jsonl"
    path = tmp_path / f"fake-tf-python-{mode}"
    path.write_text(FAKE.format(python=sys.executable, log=str(log), mode=mode))
    path.chmod(0o755)
    return str(path), log


def _log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(60)
def test_tf_rows_are_interleaved_with_the_torch_rounds_and_the_ratio_column_uses_this_runs_tf_time(
    tmp_path, monkeypatch
):
    python, log = _fake(tmp_path)
    order: list[str] = []

    def fake_setup(kind, replicas, sizes, batch, compiled):  # torch side without building/compiling models
        def step():
            order.append(f"{kind}{replicas}{'c' if compiled else ''}")
        return step

    monkeypatch.setattr(train_inproc, "_setup", fake_setup)
    result = train_inproc.run(steps=20, warmup=1, rounds=3, groups=("compile",), threads=1, tf_python=python)
    rows = result.rows
    names = [r["runner"] for r in rows]
    assert names == [
        "in-process torch eager", "in-process torch compiled", "in-process torch eager, 2 slices",
        "in-process torch compiled, 2 slices", "in-process torch eager, 2 own copies", "in-process Mirrored(2) eager",
        "in-process Mirrored(2) compiled", "TF 9.9.9-fake MirroredStrategy(2)", "TF 9.9.9-fake OneDeviceStrategy",
    ]
    by = {r["runner"]: r for r in rows}
    assert by["TF 9.9.9-fake MirroredStrategy(2)"]["ms/step"] == pytest.approx(20.0)
    assert by["TF 9.9.9-fake OneDeviceStrategy"]["steps/s"] == pytest.approx(100.0)
    for r in rows:  # steps/s over TF Mirrored's 50 steps/s, from the rows' own times
        assert r[train_inproc.TF_COLUMN] == pytest.approx(r["steps/s"] / 50.0)
    assert any("intra-op threads 1, inter-op 2" in n for n in result.notes)
    entries = _log(log)
    argv = entries[0]["argv"]
    assert argv[0] == str(tf_baseline.SCRIPT)
    # one torch thread: TF computes on one thread too (1 inter-op x 1 intra-op)
    assert {"--replicas=2", "--threads=1", "--inter-op=1", "--sizes=784,1024,1024,10", "--batch=64",
            "--lr=0.01"} <= set(argv)
    requests = entries[1:]
    # one round of each TF row after each torch round: 3 rounds, compile steps = steps // 10, warm-up 3
    assert requests == [{"row": r, "steps": 2, "warmup": 3} for r in ("mirrored", "one_device")] * 3
    assert len(order) == 3 * 7 * (2 + 3)
    for compiled in ("", " compiled"):  # Mirrored(2) over plain torch making the same two half-batch passes
        m2 = by[f"in-process Mirrored(2){compiled or ' eager'}"]
        ref = by[f"in-process torch{compiled or ' eager'}, 2 slices"]
        assert m2[train_inproc.SAME_PASSES_COLUMN] == pytest.approx(m2["ms/step"] / ref["ms/step"])
    copies = by["in-process torch eager, 2 own copies"]
    assert copies[train_inproc.SAME_PASSES_COLUMN] == pytest.approx(
        copies["ms/step"] / by["in-process torch eager, 2 slices"]["ms/step"])


@pytest.mark.parametrize("threads, expected", [(1, ("--threads=1", "--inter-op=1")),
                                               (2, ("--threads=1", "--inter-op=2")),
                                               (4, ("--threads=2", "--inter-op=2"))])
def test_tf_computes_on_as_many_threads_as_torch(tmp_path, threads, expected):
    """torch's N intra-op threads against TF's inter-op x intra-op = N (2: TF's 2 replicas side by side on
    one thread each); the TF process is only made, not started."""
    python, _ = _fake(tmp_path)
    tf = TFBaseline(python, replicas=2, threads=threads)
    assert set(expected) <= set(tf.args)
    assert tf.inter_op * tf.intra_op == threads


@pytest.mark.timeout(60)
def test_tf_rows_without_the_option_are_absent_and_need_the_compile_group(tmp_path, monkeypatch):
    monkeypatch.setattr(train_inproc, "_setup", lambda *a: (lambda: None))
    result = train_inproc.run(steps=10, warmup=1, rounds=1, groups=("compile",))
    assert not any(r["runner"].startswith("TF ") for r in result.rows)
    assert train_inproc.TF_COLUMN not in result.columns
    python, _ = _fake(tmp_path)
    with pytest.raises(ValueError, match="compile group"):
        train_inproc.run(steps=10, warmup=1, rounds=1, groups=("overhead",), tf_python=python)


def test_bench_train_refuses_tf_rows_without_the_in_process_rows(tmp_path):
    from torchstrategies.bench import train

    python, _ = _fake(tmp_path)
    with pytest.raises(ValueError, match="in_process"):
        train.run(tf_python=python, in_process=False)


@pytest.mark.timeout(60)
def test_a_python_without_tensorflow_is_a_named_error_with_its_stderr(tmp_path):
    python, _ = _fake(tmp_path, "crash")
    with pytest.raises(TFBaselineError, match=r"(?s)fake-tf-python-crash.*exit code 3.*No module named"):
        TFBaseline(python).start()
    with pytest.raises(TFBaselineError, match="cannot start"):
        TFBaseline(str(tmp_path / "no-such-python")).start()


@pytest.mark.timeout(60)
def test_a_silent_or_failing_tf_process_is_an_error_within_the_timeout_not_a_hang(tmp_path):
    python, _ = _fake(tmp_path, "silent")
    with pytest.raises(TFBaselineError, match="no answer for the ready line within 1 s"):
        TFBaseline(python, ready_timeout=1.0).start()
    python, _ = _fake(tmp_path, "wrong")
    with TFBaseline(python) as tf:
        with pytest.raises(TFBaselineError, match="it reported: no such row"):
            tf.seconds_per_step("mirrored", steps=1, warmup=0)
    with pytest.raises(ValueError, match="'nope'"):
        TFBaseline(python).seconds_per_step("nope", steps=1, warmup=0)


def test_the_shipped_tf_script_compiles_and_imports_only_tensorflow_numpy_and_the_standard_library(tmp_path):
    py_compile.compile(str(tf_baseline.SCRIPT), cfile=str(tmp_path / "x.pyc"), doraise=True)
    tree = ast.parse(tf_baseline.SCRIPT.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    third_party = roots - set(sys.stdlib_module_names)
    assert third_party == {"tensorflow", "numpy"}, roots


def test_the_cli_passes_tf_python_and_tf_inter_op_to_bench_train(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from torchstrategies.bench import train
    from torchstrategies.bench.report import BenchResult
    from torchstrategies_cli import main

    python, _ = _fake(tmp_path)
    seen: list[dict] = []

    def fake_run(nproc=2, in_process=True, tf_python=None, tf_inter_op=None, progress=True):
        seen.append({"tf_python": tf_python, "tf_inter_op": tf_inter_op})
        return BenchResult("t", ["runner"], [{"runner": "x"}])

    monkeypatch.setattr(train, "run", fake_run)
    r = CliRunner().invoke(main, ["bench", "train", "--tf-python", python, "--tf-inter-op", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert seen == [{"tf_python": python, "tf_inter_op": 1}]
    r = CliRunner().invoke(main, ["bench", "train", "--tf-python", str(tmp_path / "absent")])
    assert r.exit_code == 2 and "absent" in r.output
