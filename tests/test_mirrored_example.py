"""examples/mirrored_digits.py --fast reaches >= 0.95 held-out accuracy and writes its --result-json file."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest


@pytest.mark.timeout(120)
def test_mirrored_digits_example_fast(capsys, tmp_path):
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "mirrored_digits.py"
    spec = importlib.util.spec_from_file_location("mirrored_digits", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--fast", "--result-json", str(tmp_path / "r.json")])
    assert "RESULT" not in capsys.readouterr().out  # the human output has no machine-readable line
    parsed = json.loads((tmp_path / "r.json").read_text())
    assert parsed == result and parsed["strategy"] == "MirroredStrategy"
    assert parsed["accuracy"] >= 0.95 and parsed["samples_per_sec"] > 0
