"""Issue 37: keras is an optional extra. Importing torchstrategies, and training a torch model under a
strategy, never imports keras (a Keras model is recognized by its classes' module names). Runs with or
without keras installed."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch
import torchstrategies as ts
import torchstrategies.strategies
with ts.MirroredStrategy(num_replicas=2).scope():
    torch.nn.Linear(2, 1)
print(sorted(m for m in sys.modules if m == "keras" or m.startswith("keras.")))
"""


def test_importing_torchstrategies_never_imports_keras():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
