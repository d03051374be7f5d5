"""examples/multi_worker_digits.py under torchrun with 2 workers reaches >= 0.95 held-out accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_multi_worker_digits_example_trains_to_95_percent_with_two_workers(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "multi_worker_digits.py"), "--fast",
           "--result-json", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("held-out accuracy") == 1, proc.stdout[-2000:]  # rank 0 alone reports
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["strategy"] == "MultiWorkerMirroredStrategy"
    assert result["accuracy"] >= 0.95, result
    assert result["samples_per_sec"] > 0
    assert "train:" in proc.stderr  # the progress bar (rank 0)
