"""The backend's one rule for shapes, and reductions no implementation takes (issue 47): calls that differ
only in their tensors' shapes raise a collective mismatch on every rank (SHM, RING, HIERARCHICAL), the same
calls made alike work; int16 reductions, AVG of integers or bools and bitwise ops on floats raise ValueError
naming the dtype and the op on every rank before any data moves, and the group keeps working."""

from __future__ import annotations

import _backend_shape_bodies as S
import pytest
from harness import run_ranks

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py

_HOSTS_2_1 = lambda r: {"TORCHSTRATEGIES_HOST_ID": "hostA" if r < 2 else "hostB"}  # noqa: E731
_JOBS = [("SHM", 2, None, "SHM"), ("RING", 2, None, "RING"), ("HIERARCHICAL", 3, _HOSTS_2_1, "HIERARCHICAL")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("impl, world, hosts, plan", _JOBS)
def test_calls_that_differ_only_in_shape_raise_on_every_rank_and_alike_calls_work(impl, world, hosts, plan):
    res = run_ranks(S.shape_pairs, world, args=(impl,), timeout=190, env_per_rank=hosts)
    for rank, out in enumerate(res):
        assert out.pop("plan") == plan, (rank, plan)
        assert out.pop("alike") == [], rank
        assert len(out) == len(S._shape_pairs(world)) * len({1, world - 1})
        for case, (raised, next_right) in out.items():
            assert raised.startswith("DistBackendError: torchstrategies ValueError: collective mismatch"), (
                rank, case, raised)
            assert "the tensors' shapes or dtypes" in raised, (rank, case, raised)
            assert next_right, (rank, case, "the next calls gave wrong results")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("impl, world, hosts, plan", _JOBS)
def test_reductions_no_implementation_takes_raise_value_error_naming_dtype_and_op_on_every_rank(impl, world, hosts,
                                                                                              plan):
    res = run_ranks(S.unsupported, world, args=(impl,), timeout=190, env_per_rank=hosts)
    for rank, out in enumerate(res):
        raised, next_right = out.pop("mismatch")
        assert raised.startswith("DistBackendError: torchstrategies ValueError: collective mismatch"), (rank, raised)
        assert next_right, rank
        for case, (raised, next_right) in out.items():
            what, dtype, op = case.split()
            want = f"ValueError: torchstrategies {what}: no implementation reduces {dtype} with {op}"
            assert raised.startswith(want), (rank, case, raised)
            assert "Invalid scalar type" not in raised, (rank, case, raised)
            assert next_right, (rank, case, "the next calls gave wrong results")
