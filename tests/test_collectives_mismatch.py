"""Mismatched calls between ranks raise ValueError on every rank: never a crash inside gloo, never a silent
wrong result, and the group keeps working afterwards (issue 14)."""

from __future__ import annotations

import _fault_bodies as F
import pytest
from harness import run_ranks

_HOSTS = {"HIERARCHICAL": lambda r: {"TORCHSTRATEGIES_HOST_ID": f"host{r}"}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", ["SHM", "RING", "GLOO", "HIERARCHICAL"])
def test_mismatched_dtype_size_op_raise_value_error_on_every_rank_and_the_group_recovers(impl):
    res = run_ranks(F.mismatches, 2, args=(impl,), timeout=110, env_per_rank=_HOSTS.get(impl))
    for rank, out in enumerate(res):
        for case, field in (("dtype", "dtype"), ("size", "numel"), ("op", "op"), ("same_size_dtype", "dtype")):
            msg = out[case]
            assert msg.startswith("ValueError: collective mismatch"), (rank, case, msg)
            assert f"differs in {field}" in msg, (rank, case, msg)
            assert out[case + "_after"] == [3.0, 3.0, 3.0], (rank, case, out[case + "_after"])


@pytest.mark.timeout(120)
def test_settings_that_differ_raise_when_the_group_is_made_and_debug_mode_catches_what_gloo_would_not():
    res = run_ranks(F.settings_and_debug, 2, timeout=110)
    for rank, out in enumerate(res):
        for var in ("TORCHSTRATEGIES_SHM_SLOT_BYTES", "TORCHSTRATEGIES_RING_CHUNK_BYTES"):
            assert out[var].startswith("ValueError") and f"{var} differs" in out[var], (rank, out[var])
            assert "65536" in out[var] and "131072" in out[var], out[var]
            assert out[var + "_after"] == [3.0, 3.0, 3.0]
        assert out["debug"].startswith("ValueError: collective mismatch"), (rank, out["debug"])
        assert "all_reduce" in out["debug"] and "broadcast" in out["debug"], out["debug"]
        assert out["debug_after_same_group"] == [3.0, 3.0, 3.0]
        assert out["debug_after_new_group"] == [3.0, 3.0]
        assert out["gloo_op"].startswith("ValueError: collective mismatch"), out["gloo_op"]
