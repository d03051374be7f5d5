"""Bad input to the reduction ops: a clear error naming the problem and the value, never a crash."""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts

OPS = [ts.ops.accumulate_n, ts.ops.tree_reduce]
RAW = [torch.ops.torchstrategies.accumulate_n, torch.ops.torchstrategies.tree_reduce]
ALL = [*OPS, ts.ops.add_n]


@pytest.mark.parametrize("op", ALL)
def test_empty_list(op) -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        op([])


@pytest.mark.parametrize("raw", RAW)
def test_empty_list_through_torch_ops(raw) -> None:
    with pytest.raises(RuntimeError, match="non-empty list"):
        raw([], None)


@pytest.mark.parametrize("op", ALL)
def test_non_tensor_item_names_its_index(op) -> None:
    with pytest.raises(TypeError, match=r"tensors\[2\] is a float"):
        op([torch.ones(3), torch.ones(3), 1.0])
    with pytest.raises(TypeError, match="single Tensor"):
        op(torch.ones(3))
    with pytest.raises(TypeError, match="expected a list of tensors, got int"):
        op(5)


@pytest.mark.parametrize("op", ALL)
def test_mismatched_shape_dtype_device_name_the_index(op) -> None:
    with pytest.raises(ValueError, match=r"tensors\[2\] has shape \(4,\) but tensors\[0\] has shape \(3,\)"):
        op([torch.ones(3), torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match=r"tensors\[1\] has dtype torch.float64"):
        op([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[1\] has device meta"):
        op([torch.ones(3), torch.ones(3, device="meta")])


@pytest.mark.parametrize("raw", RAW)
def test_mismatches_through_torch_ops_name_the_index(raw) -> None:
    with pytest.raises(RuntimeError, match=r"tensors\[2\] has shape \[4\] but tensors\[0\] has shape \[3\]"):
        raw([torch.ones(3), torch.ones(3), torch.ones(4)], None)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double but tensors\[0\] has dtype Float"):
        raw([torch.ones(3), torch.ones(3, dtype=torch.float64)], None)
    with pytest.raises(RuntimeError, match=r"unsupported dtype Bool"):
        raw([torch.ones(3, dtype=torch.bool)], None)
    with pytest.raises(RuntimeError, match=r"scale=0.5 needs a floating-point dtype, got Int"):
        raw([torch.ones(3, dtype=torch.int32)], 0.5)


@pytest.mark.parametrize("op", OPS)
def test_out_of_wrong_shape_or_dtype(op) -> None:
    xs = [torch.ones(3), torch.ones(3)]
    with pytest.raises(ValueError, match=r"out has shape \(4,\)"):
        op(xs, out=torch.empty(4))
    with pytest.raises(ValueError, match=r"out has dtype torch.float16"):
        op(xs, out=torch.empty(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="out is a list"):
        op(xs, out=[0.0, 0.0, 0.0])


def test_out_of_wrong_shape_through_torch_ops() -> None:
    xs = [torch.ones(3), torch.ones(3)]
    with pytest.raises(RuntimeError, match=r"out has shape \[4\] but the inputs have shape \[3\]"):
        torch.ops.torchstrategies.accumulate_n_out(xs, None, torch.empty(4))
    with pytest.raises(RuntimeError, match=r"out has dtype Half but the inputs have dtype Float"):
        torch.ops.torchstrategies.tree_reduce_out(xs, None, torch.empty(3, dtype=torch.half))
    with pytest.raises(RuntimeError, match=r"dst has shape \[2\]"):
        torch.ops.torchstrategies.accumulate_(torch.empty(2), xs)


def test_out_partially_overlapping_an_input_is_rejected() -> None:
    base = torch.arange(10.0)
    xs = [base[0:8], torch.ones(8)]
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.ops.torchstrategies.accumulate_n_out(xs, None, base[1:9])


@pytest.mark.parametrize("op", ALL)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.complex64], ids=str)
def test_unsupported_dtype(op, dtype) -> None:
    with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
        op([torch.zeros(3, dtype=dtype), torch.zeros(3, dtype=dtype)])


@pytest.mark.parametrize("op", OPS)
def test_scale_on_integers_or_of_a_wrong_type(op) -> None:
    with pytest.raises(TypeError, match="scale=0.5 needs a floating-point dtype, got torch.int64"):
        op([torch.ones(3, dtype=torch.int64)], scale=0.5)
    with pytest.raises(TypeError, match="scale must be a float or None, got str"):
        op([torch.ones(3)], scale="0.5")
    with pytest.raises(TypeError, match="scale must be a float or None, got bool"):
        op([torch.ones(3)], scale=True)


def test_accumulate_inplace_errors() -> None:
    with pytest.raises(TypeError, match="dst is a list"):
        ts.ops.accumulate_([1.0], [torch.ones(1)])
    with pytest.raises(ValueError, match=r"dst has shape \(2,\)"):
        ts.ops.accumulate_(torch.ones(2), [torch.ones(3)])
    with pytest.raises(ValueError, match="dst has dtype torch.int32"):
        ts.ops.accumulate_(torch.ones(3, dtype=torch.int32), [torch.ones(3)])
    with pytest.raises(ValueError, match="non-empty"):
        ts.ops.accumulate_(torch.ones(3), [])


def test_out_with_autograd_is_refused() -> None:
    xs = [torch.ones(3, requires_grad=True), torch.ones(3)]
    with pytest.raises(RuntimeError, match="does not support autograd"):
        ts.ops.accumulate_n(xs, out=torch.empty(3))
    with torch.no_grad():
        assert ts.ops.accumulate_n(xs, out=torch.empty(3)).tolist() == [2.0, 2.0, 2.0]


def test_the_dtype_table_comes_from_the_extension_and_matches_what_the_kernels_take() -> None:
    """ops.SUPPORTED_DTYPES / FLOAT_DTYPES / DTYPE_CODES are derived from ``_C.DTYPES`` (csrc/checks.h), and
    the C++ kernels take exactly the dtypes that table marks as theirs."""
    from torchstrategies._ext import _C

    table = dict(_C.DTYPES)
    assert set(ts.ops.SUPPORTED_DTYPES) == {d for d, (_, k, _) in table.items() if k >= 0}
    assert ts.ops.FLOAT_DTYPES == tuple(d for d in ts.ops.SUPPORTED_DTYPES if d.is_floating_point)
    assert ts.ops.DTYPE_CODES == {d: c for d, (c, _, _) in table.items()}
    assert len(set(ts.ops.DTYPE_CODES.values())) == len(table)  # distinct codes: a mismatch is always seen
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.complex64, torch.complex128):
        assert dtype in ts.ops.DTYPE_CODES  # GLOO's dtypes have descriptor codes too
    for dtype, (_, kernel_code, is_float) in table.items():
        assert is_float == dtype.is_floating_point, dtype
        xs = [torch.ones(3, dtype=dtype), torch.ones(3, dtype=dtype)]
        if kernel_code >= 0:
            assert torch.ops.torchstrategies.accumulate_n(xs, None).tolist() == [2, 2, 2], dtype
        else:
            with pytest.raises(RuntimeError, match="unsupported dtype"):
                torch.ops.torchstrategies.accumulate_n(xs, None)
