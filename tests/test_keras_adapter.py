"""Issue 50: Keras is reached through one typed adapter (torchstrategies/strategies/_keras_api.py). Its checks
and a small ``fit`` under MirroredStrategy(2) (against one process, same global batches) run against the
current Keras and the previous minor release (installed with ``pip install --target`` into a cache
directory, never into the environment; skipped, saying why, when it cannot be installed)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from torchstrategies.strategies import _keras_api as api

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "keras_adapter_check.py")
TOL = 1e-5

try:
    CURRENT = Version(importlib.metadata.version("keras"))
except importlib.metadata.PackageNotFoundError:
    pytest.skip("keras is not installed (pip install torchstrategies[keras])", allow_module_level=True)


def _previous_minor_dir() -> str:
    """A directory holding the newest release of the previous Keras minor (installed once, then reused)."""
    spec = f"keras>={CURRENT.major}.{CURRENT.minor - 1},<{CURRENT.major}.{CURRENT.minor}"
    cache = os.environ.get("TORCHSTRATEGIES_KERAS_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "torchstrategies"))
    target = os.path.join(cache, f"keras-{CURRENT.major}.{CURRENT.minor - 1}")
    if os.path.isdir(os.path.join(target, "keras")):
        return target
    partial = f"{target}.tmp-{os.getpid()}"
    # --no-deps: the environment already has Keras' dependencies (those of the current release)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", partial, spec]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"could not install {spec} (pip took over 300 s): the previous Keras minor is not checked")
    if out.returncode != 0:
        pytest.skip(f"could not install {spec} with pip (exit {out.returncode}: {out.stderr.strip()[-300:]}): "
                    "the previous Keras minor is not checked")
    os.makedirs(cache, exist_ok=True)
    try:
        os.replace(partial, target)
    except OSError:  # another run installed it meanwhile
        pass
    return target


def _run_check(keras_dir: str | None) -> dict:
    env = dict(os.environ, KERAS_BACKEND="torch")
    path = [p for p in (keras_dir, ROOT, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", ["current", "previous_minor"])
def test_the_keras_adapter_and_a_mirrored_fit_work_with_the_current_and_previous_keras_minor(release):
    keras_dir = _previous_minor_dir() if release == "previous_minor" else None
    got = _run_check(keras_dir)
    version = Version(got["keras"])
    if release == "current":
        assert version == CURRENT
    else:
        assert (version.major, version.minor) == (CURRENT.major, CURRENT.minor - 1), got
        assert got["keras_file"].startswith(keras_dir)
    assert got["checked"] == ["model", "batch_norm", "random_layer", "variables", "model_checkpoint"]
    assert got["max_diff"] <= TOL, got  # MirroredStrategy(2) equals one process on the global batches
    assert got["rows"] == {"0": 57, "1": 54}  # each replica ran its rows of every global batch


class BatchNormalization:  # a Keras release whose BatchNormalization renamed _moments
    name = "bn"
    _reduction_axes = (0,)


class _Dropout:
    seed_generator = None  # no random numbers: not a random layer


def test_a_keras_member_the_adapter_uses_that_is_missing_is_named():
    with pytest.raises(api.KerasAdapterError, match=r"BatchNormalization 'bn' .* has no _moments: torchstrategies "
                                                    r"uses _moments, _reduction_axes, name of it"):
        api.batch_norm(BatchNormalization())
    assert api.random_layer(_Dropout()) is None
    assert api.batch_norm(_Dropout()) is None
    assert api.members(api.CompiledModel) == tuple(sorted({*api.members(api.KerasModel), "optimizer"}))
