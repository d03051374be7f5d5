"""The rotating slice has one definition (``ops.agreement_piece``, csrc/cpu/agreement_step.cpp), and a piece's
fingerprints one path, so the MWMS check (``ops.agreement_hash_``) and the in-process strategies' check
(``ops.agreement_piece_fingerprints``) compare the same values of the same bytes: a changed element changes the
fingerprint of exactly the piece ``agreement_piece`` puts it in, for contiguous, non-contiguous, empty, 0-d and
mixed-dtype tensor lists. Bad pieces are named; ``agreement_piece`` reads metadata only and
``agreement_piece_fingerprints`` reads bytes through ``hash_tensors``, so every device's tensors take them.
"""

from __future__ import annotations

import os

import pytest
import torch

import torchstrategies as ts
from torchstrategies.distribute.agreement_step import AGREEMENT_SLICES, StepTensors


def _tensors() -> list[torch.Tensor]:
    """Mixed dtypes (piece boundaries inside elements), an empty, a non-contiguous and a 0-d tensor."""
    def values(n: int, dtype: torch.dtype) -> torch.Tensor:
        return (torch.arange(n) % 7).to(dtype)

    return [values(15, torch.float32).reshape(5, 3), values(0, torch.float32), values(7, torch.float64),
            values(16, torch.float32).reshape(4, 4).t(), values(1, torch.int8), values(1, torch.bfloat16)[0],
            values(9, torch.int16), values(12, torch.float32).reshape(3, 4)[:, 1:3]]


def _changed(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` (same shape, strides and dtype) with element ``k`` of its flat (logical) order changed."""
    flat = t.reshape(-1).clone()
    flat[k] += 1
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    out.copy_(flat.view(t.shape))
    return out


def _mwms_piece_fingerprints(tensors: list[torch.Tensor], piece: int, slices: int) -> list[int]:
    """What the MWMS check compares of this piece: ``agreement_hash_``'s piece fingerprint per tensor."""
    lists = StepTensors()
    lists.use(tensors, [])
    ts.ops.agreement_hash_(lists.tensors, lists.state, lists.payload, lists.forced_from, piece, slices)
    n = len(tensors)
    return lists.payload[2 * n:3 * n].tolist()


def _ranges(tensors: list[torch.Tensor], piece: int, slices: int) -> dict[int, tuple[int, int]]:
    """``agreement_piece``'s rows as {tensor index: [a, b)} for the tensors with a part in the piece."""
    return {i: (a, b) for i, (a, b) in enumerate(ts.ops.agreement_piece(tensors, piece, slices).tolist()) if b > a}


@pytest.mark.parametrize("slices", [1, 3, 7, AGREEMENT_SLICES])
def test_a_changed_element_changes_the_piece_agreement_piece_names_on_both_paths(slices):
    base = _tensors()
    assert not base[3].is_contiguous() and base[1].numel() == 0 and base[5].dim() == 0
    assert not base[7].is_contiguous() and base[7].storage_offset() == 1
    ranges = [_ranges(base, p, slices) for p in range(slices)]
    mwms = [_mwms_piece_fingerprints(base, p, slices) for p in range(slices)]
    for p in range(slices):
        # the MWMS check hashes a piece of exactly the tensors agreement_piece names, and the in-process check
        # compares the very same values
        assert [i for i, f in enumerate(mwms[p]) if f != 0] == sorted(ranges[p]), (slices, p)
        assert ts.ops.agreement_piece_fingerprints(base, p, slices).tolist() == mwms[p], (slices, p)
    for i, t in enumerate(base):
        for k in range(t.numel()):
            holders = [p for p in range(slices) if i in ranges[p] and ranges[p][i][0] <= k < ranges[p][i][1]]
            assert len(holders) == 1, (slices, i, k, holders)   # every element in exactly one piece
            tensors = [*base[:i], _changed(t, k), *base[i + 1:]]
            for p in range(slices):
                expect = {i} if p in holders else set()
                got = _mwms_piece_fingerprints(tensors, p, slices)
                assert {j for j in range(len(base)) if got[j] != mwms[p][j]} == expect, ("mwms", slices, i, k, p)
                seen = ts.ops.agreement_piece_fingerprints(tensors, p, slices)
                assert seen.dtype == torch.int64 and seen.device.type == "cpu"
                assert seen.tolist() == got, ("in-process", slices, i, k, p)


def test_a_piece_is_rows_of_element_ranges_cut_from_the_bytes_laid_end_to_end():
    # bytes: 12 (float32 x3) + 0 + 3 (int8 x3) + 16 (float64 x2, not contiguous) + 8 (float64 x1) = 39, in 3
    # pieces [0, 13), [13, 26), [26, 39); an element is in the piece that holds its first byte
    tensors = [torch.zeros(3), torch.zeros(0), torch.zeros(3, dtype=torch.int8),
               torch.zeros(2, 2, dtype=torch.float64)[:, 0], torch.zeros(1, dtype=torch.float64)]
    rows = [ts.ops.agreement_piece(tensors, p, 3) for p in range(3)]
    assert all(r.dtype == torch.int64 and r.shape == (5, 2) and r.device.type == "cpu" for r in rows)
    assert [r.tolist() for r in rows] == [
        [[0, 3], [0, 0], [0, 1], [0, 0], [0, 0]],
        [[0, 0], [0, 0], [1, 3], [0, 2], [0, 0]],    # the non-contiguous one whole, where it starts (byte 15)
        [[0, 0], [0, 0], [0, 0], [0, 0], [0, 1]],
    ]
    assert _ranges(tensors, 1, 3) == {2: (1, 3), 3: (0, 2)}
    assert ts.ops.agreement_piece([], 0, 1).shape == (0, 2) and _ranges([], 0, 1) == {}
    assert ts.ops.agreement_piece_fingerprints([], 0, 1).shape == (0,)


@pytest.mark.parametrize(("piece", "slices"), [(0, 0), (-1, 3), (3, 3), (0, -2)])
def test_a_piece_out_of_range_is_named_by_both_ops_and_under_fake_tensors(piece, slices):
    from torch._subclasses.fake_tensor import FakeTensorMode

    message = rf"piece {piece} of {slices} slices: expected slices >= 1 and 0 <= piece < slices"
    with pytest.raises(RuntimeError, match=f"agreement_piece: {message}"):
        ts.ops.agreement_piece([torch.zeros(4)], piece, slices)
    with pytest.raises(RuntimeError, match=f"agreement_hash_: {message}"):
        _mwms_piece_fingerprints([torch.zeros(4)], piece, slices)
    for op in ("agreement_piece", "agreement_piece_fingerprints"):
        with pytest.raises(RuntimeError, match=f"{op}: {message}"):
            getattr(ts.ops, op)([torch.zeros(4)], piece, slices)
        with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=f"{op}: {message}"):
            getattr(ts.ops, op)([mode.from_tensor(torch.zeros(4))], piece, slices)


def test_a_sparse_tensor_is_refused_by_name():
    for op in ("agreement_piece", "agreement_piece_fingerprints"):
        with pytest.raises(RuntimeError, match=rf"{op}: tensors\[1\] has layout Sparse"):
            getattr(ts.ops, op)([torch.zeros(2), torch.zeros(3).to_sparse()], 0, 1)


def test_the_piece_traces_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        tensors = [mode.from_tensor(torch.ones(3)), mode.from_tensor(torch.ones(5, 2))]
        out = ts.ops.agreement_piece(tensors, 0, 2)
        fingerprints = ts.ops.agreement_piece_fingerprints(tensors, 0, 2)
    assert out.shape == (2, 2) and out.dtype == torch.int64 and out.device.type == "cpu"
    assert fingerprints.shape == (2,) and fingerprints.dtype == torch.int64 and fingerprints.device.type == "cpu"


def test_the_piece_reads_metadata_only_so_one_kernel_serves_every_device():
    # registered once, CompositeExplicitAutograd: a CUDA replica's list takes it also in a CPU-only build
    for op in ("agreement_piece", "agreement_piece_fingerprints"):
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"torchstrategies::{op}", key), (op, key)


def test_the_piece_of_cuda_tensors_equals_the_cpu_piece():
    if not torch.cuda.is_available():
        if os.environ.get("TORCHSTRATEGIES_TEST_GPU") == "1":
            pytest.fail("TORCHSTRATEGIES_TEST_GPU=1 but no CUDA device")
        pytest.skip("no CUDA device")
    base = _tensors()
    on_gpu = [t.cuda() if t.is_contiguous() else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                      device="cuda").copy_(t) for t in base]
    assert [t.is_contiguous() for t in on_gpu] == [t.is_contiguous() for t in base]
    for p in range(3):
        assert ts.ops.agreement_piece(on_gpu, p, 3).tolist() == ts.ops.agreement_piece(base, p, 3).tolist()
        assert (ts.ops.agreement_piece_fingerprints(on_gpu, p, 3).tolist()
                == ts.ops.agreement_piece_fingerprints(base, p, 3).tolist())
