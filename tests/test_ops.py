"""accumulate_n / tree_reduce / accumulate_ / add_n against float64 and exact-order references."""

from __future__ import annotations

import pytest
import reference as ref
import torch

import torchstrategies as ts

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 4097]
BIG = (1 << 20) + 3
NS = [1, 2, 3, 8, 13, 64]  # 13: the blocked path with a remainder group (8 + 5)


def make(n: int, size: int | tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (size,) if isinstance(size, int) else size
    if dtype.is_floating_point:
        return [(torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype) for _ in range(n)]
    info = torch.iinfo(dtype)
    # Large values, so int32 sums wrap: the kernels must wrap like torch's int32 adds.
    return [torch.randint(info.min // 2, info.max // 2, shape, generator=g, dtype=dtype) for _ in range(n)]


def check_close(out: torch.Tensor, xs: list[torch.Tensor], scale: float | None = None) -> None:
    assert out.dtype == xs[0].dtype and out.shape == xs[0].shape
    want = ref.float64_sum(xs, scale)
    if xs[0].dtype.is_floating_point:
        err = (out.to(torch.float64) - want).abs()
        assert bool((err <= ref.tolerance(xs, want, scale)).all()), (
            f"max error {err.max().item()}"
        )
    else:
        assert torch.equal(out, want.to(xs[0].dtype))  # int64 sum, wrapped to int32 as torch does


def test_float64_reference_matches_pure_python() -> None:
    for dtype in (torch.float32, torch.int32):
        xs = make(5, 33, dtype)
        py = ref.python_sum(xs)
        f64 = ref.float64_sum(xs).tolist()
        assert py == pytest.approx(f64, rel=1e-15, abs=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", NS)
def test_accumulate_n_and_tree_reduce_match_references(dtype: torch.dtype, n: int) -> None:
    for size in SIZES:
        xs = make(n, size, dtype, seed=size + n)
        a = ts.ops.accumulate_n(xs)
        t = ts.ops.tree_reduce(xs)
        check_close(a, xs)
        check_close(t, xs)
        # Same order of operations as the references: equal bit for bit.
        assert torch.equal(a, ref.sequential_sum(xs))
        assert torch.equal(t, ref.pairwise_sum(xs))
        if size and size < 64:  # the pure-Python ground truth on small sizes
            py = ref.python_sum(xs)
            if dtype.is_floating_point:
                assert a.double().tolist() == pytest.approx(py, rel=n * 1e-2, abs=n * 1e-2)
            else:
                assert a.tolist() == ref.float64_sum(xs).to(dtype).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_odd_size_splits_across_threads_and_blocks(dtype: torch.dtype) -> None:
    for n in (3, 8) if dtype == torch.float32 else (8,):
        xs = make(n, BIG, dtype, seed=n)
        a = ts.ops.accumulate_n(xs)
        assert torch.equal(a, ref.sequential_sum(xs))
        assert torch.equal(ts.ops.tree_reduce(xs), ref.pairwise_sum(xs))
        check_close(a, xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_scale_multiplies_the_sum(dtype: torch.dtype, n: int) -> None:
    xs = make(n, 4097, dtype)
    for op in (ts.ops.accumulate_n, ts.ops.tree_reduce):
        check_close(op(xs, scale=1.0 / n), xs, 1.0 / n)
        check_close(op(xs, scale=-2.5), xs, -2.5)


def test_add_n_is_the_sequential_torch_sum() -> None:
    xs = make(8, 4097, torch.float32)
    assert torch.equal(ts.ops.add_n(xs), ref.sequential_sum(xs))
    assert ts.ops.add_n(xs[:1]) is not xs[0]  # a copy, never the input itself


def test_any_shape_works_and_keeps_the_shape() -> None:
    xs = make(4, (3, 5, 7), torch.float32)
    out = ts.ops.accumulate_n(xs)
    assert out.shape == (3, 5, 7)
    assert torch.equal(out, ref.sequential_sum(xs))
    scalars = [torch.tensor(float(i)) for i in range(5)]
    assert ts.ops.tree_reduce(scalars).item() == 10.0 and ts.ops.tree_reduce(scalars).dim() == 0


def noncontiguous_variants(x: torch.Tensor) -> list[torch.Tensor]:
    """Three non-contiguous views holding the same values as contiguous x of shape (64, 65)."""
    t = x.t().contiguous().t()  # transposed storage
    s = torch.empty(64, 130, dtype=x.dtype)[:, ::2]  # every other column
    s.copy_(x)
    e = x[:1].expand(64, 65)  # stride 0: broadcast row
    return [t, s, e]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_inputs(dtype: torch.dtype) -> None:
    xs = make(4, (64, 65), dtype)
    views = noncontiguous_variants(xs[0]) + noncontiguous_variants(xs[1])
    assert not any(v.is_contiguous() for v in views)
    dense = [v.contiguous() for v in views]
    assert torch.equal(ts.ops.accumulate_n(views), ref.sequential_sum(dense))
    assert torch.equal(ts.ops.tree_reduce(views), ref.pairwise_sum(dense))


@pytest.mark.parametrize("op,order", [(ts.ops.accumulate_n, ref.sequential_sum),
                                      (ts.ops.tree_reduce, ref.pairwise_sum)])
def test_noncontiguous_out(op, order) -> None:
    xs = make(5, (64, 65), torch.float32)
    base = torch.full((65, 64), 7.0)
    out = base.t()  # non-contiguous (64, 65) view
    got = op(xs, out=out)
    assert got is out
    assert torch.equal(out, order(xs))
    strided = torch.zeros(2 * 4097)
    r = op(make(5, 4097, torch.float32), out=strided[::2])
    assert torch.equal(strided[::2], r) and bool((strided[1::2] == 0).all())  # gaps untouched


@pytest.mark.parametrize("op,order", [(ts.ops.accumulate_n, ref.sequential_sum),
                                      (ts.ops.tree_reduce, ref.pairwise_sum)])
@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_out_may_alias_an_input(op, order, n: int) -> None:
    for size in (7, 4097, BIG if n <= 3 else 4097):
        xs = make(n, size, torch.float32, seed=n)
        want = order(xs)
        first = [x.clone() for x in xs]
        assert op(first, out=first[0]) is first[0]
        assert torch.equal(first[0], want)
        middle = [x.clone() for x in xs]
        op(middle, out=middle[n // 2])
        assert torch.equal(middle[n // 2], want)


def test_out_may_alias_an_input_with_scale() -> None:
    xs = make(8, 4097, torch.float32)
    want = ref.sequential_sum(xs, 0.125)
    ts.ops.accumulate_n(xs, out=xs[0], scale=0.125)
    assert torch.equal(xs[0], want)


def test_out_repeated_input_in_list() -> None:
    x = make(1, 4097, torch.float32)[0]
    xs = [x, x.clone(), x]
    want = ref.sequential_sum([t.clone() for t in xs])
    ts.ops.accumulate_n(xs, out=x)
    assert torch.equal(x, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_accumulate_inplace_adds_into_dst(dtype: torch.dtype, n: int) -> None:
    for size in (0, 7, 4097):
        xs = make(n + 1, size, dtype, seed=n)
        dst, rest = xs[0].clone(), xs[1:]
        ptr = dst.data_ptr()
        assert ts.ops.accumulate_(dst, rest) is dst
        assert dst.data_ptr() == ptr
        assert torch.equal(dst, ref.sequential_sum(xs))


def test_accumulate_inplace_noncontiguous_dst() -> None:
    xs = make(3, (64, 65), torch.float32)
    dst = torch.empty(65, 64).t()
    dst.copy_(xs[0])
    ts.ops.accumulate_(dst, xs[1:])
    assert torch.equal(dst, ref.sequential_sum(xs))


def test_tree_reduce_error_is_smaller_than_sequential_on_badly_conditioned_float32() -> None:
    # Constructed: 1.0 followed by 63 terms of half an ulp of 1.0. Sequentially each 1 + 2^-24 rounds
    # back to 1.0 (ties to even), losing every small term; pairwise sums the small terms first.
    n, size = 64, 4097
    xs = [torch.ones(size)] + [torch.full((size,), 2.0**-24) for _ in range(n - 1)]
    exact = 1.0 + 63 * 2.0**-24
    seq_err = (ts.ops.accumulate_n(xs).double() - exact).abs().max().item()
    tree_err = (ts.ops.tree_reduce(xs).double() - exact).abs().max().item()
    add_err = (ts.ops.add_n(xs).double() - exact).abs().max().item()
    assert seq_err == add_err == pytest.approx(63 * 2.0**-24)
    assert tree_err < seq_err / 8
    # And on random data with a large common offset the mean error is measurably smaller too.
    g = torch.Generator().manual_seed(0)
    ys = [(1000 + torch.rand(1 << 13, generator=g, dtype=torch.float64)).float() for _ in range(n)]
    exact64 = ref.float64_sum(ys)
    seq = (ts.ops.accumulate_n(ys).double() - exact64).abs().mean().item()
    tree = (ts.ops.tree_reduce(ys).double() - exact64).abs().mean().item()
    assert tree < seq / 2, (tree, seq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("per", [1, 3])
def test_accumulate_grouped_is_accumulate_of_each_group_in_one_call(dtype, per):
    shapes = [(0,), (7,), (3, 5), (4097,)]
    dsts = [make(1, sh, dtype, seed=i)[0] for i, sh in enumerate(shapes)]
    groups = [make(per, sh, dtype, seed=10 + i) for i, sh in enumerate(shapes)]
    want = [ts.ops.accumulate_(d.clone(), g) for d, g in zip(dsts, groups)]
    versions = [d._version for d in dsts]
    ts.ops.accumulate_grouped_(dsts, groups)
    for d, w in zip(dsts, want):
        torch.testing.assert_close(d, w, rtol=0, atol=0)
    assert all(d._version > v for d, v in zip(dsts, versions))  # autograd sees the in-place writes


def test_accumulate_grouped_errors_name_the_group_and_the_problem():
    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match="2 destinations but 1 groups"):
        ts.ops.accumulate_grouped_([a, b], [[a]])
    with pytest.raises(ValueError, match="group 1 has 2 tensors, group 0 has 1"):
        ts.ops.accumulate_grouped_([a, b], [[torch.ones(3)], [torch.ones(4), torch.ones(4)]])
    with pytest.raises(ValueError, match=r"accumulate_grouped_: dsts\[1\] has shape \(4,\) but tensors\[0\] has "
                                         r"shape \(5,\)"):
        ts.ops.accumulate_grouped_([a, b], [[torch.ones(3)], [torch.ones(5)]])
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"):
        ts.ops.accumulate_grouped_([w], [[torch.ones(3)]])
    ts.ops.accumulate_grouped_([], [])  # nothing to do
