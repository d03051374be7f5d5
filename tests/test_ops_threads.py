"""The CPU kernels split their work over torch's intra-op pool, and the bits do not depend on the split.

``_C.reduce_ranges(numel)`` runs the one split the kernels use (``for_each_range`` in
csrc/cpu/reduce_cpu.cpp) and reports its ranges and the pool thread that ran each, so the tests see the
work spread over threads without timing anything. Every element is summed by the same serial code in the
same order whatever range holds it: results must be equal bit for bit at 1, 2, 3 and 4 threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import reference as ref
import torch

import torchstrategies as ts
from torchstrategies import _ext

C = _ext._C
GRAIN = C.REDUCE_GRAIN
THREADS = (1, 2, 3, 4)
LARGE = 4 * GRAIN + 3  # odd, and above 4 grains: cut into one range per thread at 1..4 threads
SIDE = 363  # SIDE * SIDE = 131769 > 4 * GRAIN: the 2-D (non-contiguous) cases split 4 ways too
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.float16, torch.int32]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make(n: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [(torch.randn(shape, generator=g, dtype=torch.float64) * 4).to(dtype) for _ in range(n)]
    info = torch.iinfo(dtype)
    return [torch.randint(info.min // 2, info.max // 2, shape, generator=g, dtype=dtype) for _ in range(n)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage bits as integers (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(BITS[t.element_size()])


def same_bits_at_every_thread_count(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """fn() at 1..4 threads; asserts every result has the 1-thread result's bits and returns it."""
    results = []
    for t in THREADS:
        torch.set_num_threads(t)
        results.append(fn().clone())
    for t, r in zip(THREADS[1:], results[1:]):
        assert torch.equal(bits(r), bits(results[0])), f"{t} threads differ from 1 thread"
    return results[0]


def ranges_at(threads: int, numel: int) -> list[tuple[int, int, int]]:
    torch.set_num_threads(threads)
    return [tuple(r) for r in C.reduce_ranges(numel)]


@pytest.mark.parametrize("threads", THREADS)
def test_a_large_tensor_is_cut_into_one_contiguous_range_per_thread(threads: int) -> None:
    ranges = ranges_at(threads, LARGE)
    assert len(ranges) == threads
    assert sorted(r[2] for r in ranges) == list(range(threads))  # each range ran on its own pool thread
    assert ranges[0][0] == 0 and ranges[-1][1] == LARGE
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap, no overlap
    assert all(end - begin >= GRAIN for begin, end, _ in ranges)


def test_a_tensor_of_at_most_one_grain_stays_on_the_calling_thread() -> None:
    for numel in (1, 7, GRAIN):
        assert ranges_at(4, numel) == [(0, numel, 0)]
    assert ranges_at(4, 0) == []
    assert len(ranges_at(4, GRAIN + 1)) == 2  # one element more: two ranges
    assert len(ranges_at(4, 3 * GRAIN)) == 3  # never a range below the grain, whatever the threads


def test_reduce_ranges_rejects_a_negative_count() -> None:
    with pytest.raises(RuntimeError, match="numel must be >= 0, got -1"):
        C.reduce_ranges(-1)


def every_other_column(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view (column stride 2) holding x's values."""
    v = torch.zeros(x.shape[0], 2 * x.shape[1], dtype=x.dtype)[:, ::2]
    v.copy_(x)
    return v


ORDERS = [("accumulate_n", ts.ops.accumulate_n, ref.sequential_sum),
          ("tree_reduce", ts.ops.tree_reduce, ref.pairwise_sum)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,op,order", ORDERS, ids=[o[0] for o in ORDERS])
def test_results_are_bit_identical_for_every_thread_count(dtype: torch.dtype, name: str, op, order) -> None:
    assert len(ranges_at(4, LARGE)) == 4  # the large size really is split
    for n in (3, 13):  # 3: the sum stays in registers; 13: blocked accumulator (8 + 5) / tree plan
        for size in (0, 1, 4097, LARGE):
            xs = make(n, (size,), dtype, seed=n + size)
            got = same_bits_at_every_thread_count(lambda: op(xs))
            assert torch.equal(bits(got), bits(order(xs))), (n, size)
            out = torch.empty(size, dtype=dtype)
            same_bits_at_every_thread_count(lambda: op(xs, out=out))
            assert torch.equal(bits(out), bits(got))
            if dtype.is_floating_point:
                scaled = same_bits_at_every_thread_count(lambda: op(xs, scale=1.0 / n))
                assert torch.equal(bits(scaled), bits(order(xs, 1.0 / n)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulate_inplace_is_bit_identical_for_every_thread_count(dtype: torch.dtype) -> None:
    for size in (0, 1, 4097, LARGE):
        xs = make(9, (size,), dtype, seed=size)

        def run() -> torch.Tensor:
            dst = xs[0].clone()
            ts.ops.accumulate_(dst, xs[1:])
            return dst

        assert torch.equal(bits(same_bits_at_every_thread_count(run)), bits(ref.sequential_sum(xs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("name,op,order", ORDERS, ids=[o[0] for o in ORDERS])
def test_noncontiguous_inputs_and_out_split_the_same(dtype: torch.dtype, name: str, op, order) -> None:
    assert len(ranges_at(4, SIDE * SIDE)) == 4
    xs = make(13, (SIDE, SIDE), dtype, seed=1)
    views = [x.t().contiguous().t() if i % 2 else every_other_column(x) for i, x in enumerate(xs)]
    assert not any(v.is_contiguous() for v in views)
    want = order(xs)
    assert torch.equal(bits(same_bits_at_every_thread_count(lambda: op(views))), bits(want))
    out = torch.empty(SIDE, SIDE, dtype=dtype).t()  # non-contiguous out
    same_bits_at_every_thread_count(lambda: op(views, out=out))
    assert torch.equal(bits(out), bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("name,op,order", ORDERS, ids=[o[0] for o in ORDERS])
def test_out_aliasing_an_input_is_bit_identical_for_every_thread_count(dtype: torch.dtype, name: str, op,
                                                                      order) -> None:
    for n in (3, 13):
        xs = make(n, (LARGE,), dtype, seed=n)
        want = order(xs)
        for k in (0, n // 2, n - 1):

            def run() -> torch.Tensor:
                ys = [x.clone() for x in xs]
                assert op(ys, out=ys[k]) is ys[k]
                return ys[k]

            assert torch.equal(bits(same_bits_at_every_thread_count(run)), bits(want)), (n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64], ids=str)
def test_accumulate_inplace_noncontiguous_and_aliased_is_bit_identical_for_every_thread_count(
        dtype: torch.dtype) -> None:
    xs = make(9, (SIDE, SIDE), dtype, seed=2)
    want = ref.sequential_sum(xs)

    def noncontiguous() -> torch.Tensor:
        dst = every_other_column(xs[0])  # non-contiguous dst, inputs transposed views
        ts.ops.accumulate_(dst, [x.t().contiguous().t() for x in xs[1:]])
        return dst

    def dst_among_inputs() -> torch.Tensor:  # dst + dst + x2 + ...: dst read before it is written
        dst = xs[0].clone()
        ts.ops.accumulate_(dst, [dst, *xs[2:]])
        return dst

    assert torch.equal(bits(same_bits_at_every_thread_count(noncontiguous)), bits(want))
    doubled = ref.sequential_sum([xs[0], xs[0], *xs[2:]])
    assert torch.equal(bits(same_bits_at_every_thread_count(dst_among_inputs)), bits(doubled))


def test_mirrored_gradient_sum_runs_the_split_kernel_at_torchs_thread_count(monkeypatch) -> None:
    """MirroredStrategy sums the replicas' gradients with ops.accumulate_grouped_ (its default
    ReductionToOneDevice, EXPERIMENTAL_ACCUMULATE_N): on the scheduling thread, at torch's thread count, so
    a large gradient is split over the pool, and the summed gradient has the same bits at every thread
    count."""
    from torchstrategies.distribute import cross_device_ops

    seen: list[tuple[int, int]] = []
    real = cross_device_ops.accumulate_grouped_

    def spy(dsts, groups):
        seen.extend((torch.get_num_threads(), len(C.reduce_ranges(d.numel()))) for d in dsts)
        return real(dsts, groups)

    monkeypatch.setattr(cross_device_ops, "accumulate_grouped_", spy)
    x = torch.randn(6, SIDE, generator=torch.Generator().manual_seed(3))

    def gradient() -> torch.Tensor:
        strategy = ts.MirroredStrategy(num_replicas=3)
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Linear(SIDE, SIDE, bias=False)  # SIDE * SIDE elements: four grains and more

        def step(batch: torch.Tensor) -> None:
            model(batch).square().sum().backward()

        for batch in strategy.experimental_distribute_dataset([x]):
            strategy.run(step, args=(batch,))
        assert model.weight.grad is not None
        return model.weight.grad

    for threads in THREADS:
        seen.clear()
        torch.set_num_threads(threads)
        grad = gradient()
        assert seen == [(threads, threads)], seen  # one sum, cut into one range per pool thread
    same_bits_at_every_thread_count(gradient)
    torch.manual_seed(0)
    one = torch.nn.Linear(SIDE, SIDE, bias=False)
    one(x).square().sum().backward()
    torch.testing.assert_close(grad, one.weight.grad)


def test_only_the_torch_ops_split_over_threads() -> None:
    """The transports (SHM, ring; csrc/core) reduce on the rank's own thread: under MWMS one rank per core
    already fills the host, so a pool per rank would oversubscribe (docs/kernels.md, Threads). The build
    has -fopenmp, so an OpenMP pragma or at::parallel_for anywhere else in csrc would start threads there."""
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    splitting = sorted(str(f.relative_to(csrc)) for f in csrc.rglob("*") if f.suffix in {".cpp", ".h", ".cu"}
                       and any(w in f.read_text() for w in ("#pragma omp", "parallel_for(", "omp_set", "omp_get")))
    assert splitting == ["cpu/hash_cpu.cpp", "cpu/reduce_cpu.cpp"]   # the torch ops' CPU kernels
