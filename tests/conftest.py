"""Fixtures shared by the test modules."""

from __future__ import annotations

import glob
import os

import pytest

# Keras 3 (an optional extra) is tested on the PyTorch backend: set before anything imports keras, so that
# test_docs' `requires: keras` and tests/test_keras.py find it on torch.
os.environ.setdefault("KERAS_BACKEND", "torch")


@pytest.fixture
def no_shm_leftovers():
    """Fails the test if it leaves a torchstrategies shared-memory segment in /dev/shm.

    Use with ``pytestmark = pytest.mark.usefixtures("no_shm_leftovers")``.
    """
    before = set(glob.glob("/dev/shm/torchstrat*"))
    yield
    left = set(glob.glob("/dev/shm/torchstrat*")) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
