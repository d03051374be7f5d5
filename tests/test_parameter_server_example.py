"""The digits example under torchrun (chief, 1 ps, 2 workers) trains and writes its --result-json file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

psutil = pytest.importorskip("psutil", reason="needs psutil, from the test extra: pip install -e '.[test]'")
os.environ.setdefault("TORCHSTRATEGIES_PS_SECRET", "test-job-secret-0123456789abcdef")   # the launch sets it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_parameter_server_digits_example_runs_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(ROOT, "examples", "parameter_server_digits.py"), "--fast", "--epochs", "3",
           "--result-json", str(tmp_path / "r.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["strategy"] == "ParameterServerStrategy"
    assert result["accuracy"] > 0.5            # 10 classes: chance is 0.1; the full run reaches > 0.93
    assert result["samples_per_sec"] > 0
    assert [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())] == []
