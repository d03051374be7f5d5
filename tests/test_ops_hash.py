"""hash_tensors (csrc/core/hash.h): the agreement seam's fingerprint, against the pure-Python definition.

Exact (bit for bit against tests/reference.py's XXH3-based definition of the bytes), order-sensitive
(a swap of two rows and any one-bit flip change it), the same for every thread count, CPU and CUDA alike.
"""

from __future__ import annotations

import pytest
import reference as ref
import torch

import torchstrategies as ts

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]
SIZES = [0, 1, 7, 4097]


def _tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 100
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype)
    return x.to(dtype)


def test_xxh3_reference_matches_the_xxhash_library():
    # Values of the reference library (libxxhash 0.8, XXH3_64bits_withSeed) for every length class of XXH3:
    # empty, 1-3, 4-8 (none here: the next test covers it), 17-240 and over 240 bytes, seeded and not.
    assert ref.xxh3_64(b"", 0) == 0x2D06800538D394C2
    assert ref.xxh3_64(b"a", 0) == 0xE6C632B61E964E1F
    assert ref.xxh3_64(b"abc", 0) == 0x78AF5F94892F3950
    assert ref.xxh3_64(b"abc", 1) == 0x6B4467B443C76228
    assert ref.xxh3_64(bytes(range(200)), 0) == 0xF42A8864FEAF0703
    assert ref.xxh3_64(bytes(range(256)) * 2, 0) == 0x1059105AD19BFA09
    assert ref.xxh3_64(bytes(range(256)) * 2, (1 << 56) + 3) == 0xF5AB31052F29F586


def test_xxh3_reference_matches_the_xxhash_library_at_every_length():
    xxhash = pytest.importorskip("xxhash")   # the Python binding of the reference library, where installed
    g = torch.Generator().manual_seed(0)
    for n in [*range(0, 300), 1023, 1024, 1025, 2048, 4095, 4096]:
        data = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).tolist())
        for seed in (0, 7, (2 << 56) + 9, (1 << 64) - 1):
            assert ref.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed), (n, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_hash_equals_the_pure_python_definition_of_the_bytes(dtype, n):
    t = _tensor(n, dtype)
    (h,) = ts.ops.hash_tensors([t]).tolist()
    assert h == ref.hash_bytes(ref.tensor_bytes(t))


@pytest.mark.parametrize("nbytes", [0, 1, 31, 32, 4095, 4096, 4097, 2 * 4096 * 512 + 3])
def test_hash_crosses_chunk_and_level_boundaries_as_defined(nbytes):
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    (h,) = ts.ops.hash_tensors([t]).tolist()
    assert h == ref.hash_bytes(bytes(t.tolist()))


def test_many_tensors_in_one_call_give_each_tensors_own_hash():
    shapes = [(7, torch.float32), (0, torch.int64), (4097, torch.bfloat16)]
    xs = [_tensor(n, d, seed=i) for i, (n, d) in enumerate(shapes)]
    out = ts.ops.hash_tensors(xs)
    assert out.dtype == torch.int64 and out.shape == (3,)
    assert out.tolist() == [ts.ops.hash_tensors([x]).item() for x in xs]
    assert ts.ops.hash_tensors([]).shape == (0,)


@pytest.mark.parametrize("make", [
    lambda x: x.reshape(64, 64).t(),                 # transposed
    lambda x: x[::3],                                # strided
    lambda x: x.reshape(64, 64)[:, 5:40],            # a column block
    lambda x: torch.complex(x, x).conj(),            # a conjugate view
])
def test_non_contiguous_tensors_hash_their_logical_order(make):
    v = make(_tensor(4096, torch.float32))
    (h,) = ts.ops.hash_tensors([v]).tolist()
    assert h == ts.ops.hash_tensors([v.resolve_conj().contiguous()]).item()
    assert h == ref.hash_bytes(ref.tensor_bytes(v.resolve_conj().contiguous()))


@pytest.mark.parametrize("n", [2, 7, 600, 5000])
def test_a_swap_of_two_rows_changes_the_hash(n):
    x = _tensor(n * 16, torch.float32).reshape(n, 16)
    for i, j in [(0, 1), (0, n - 1), (n // 2, n // 2 + 1 if n > 2 else 0)]:
        if i == j:
            continue
        y = x.clone()
        y[[i, j]] = y[[j, i]]
        assert not torch.equal(x, y)
        a, b = ts.ops.hash_tensors([x, y]).tolist()
        assert a != b, (n, i, j)


def test_every_one_bit_flip_of_a_small_tensor_changes_the_hash():
    x = _tensor(37, torch.float64)
    base = ts.ops.hash_tensors([x]).item()
    words = x.view(torch.int64)
    flipped = []
    for e in range(x.numel()):
        for bit in range(64):
            y = words.clone()
            y[e] ^= 1 << bit if bit < 63 else -(1 << 63)
            flipped.append(y.view(torch.float64))
    hashes = ts.ops.hash_tensors(flipped)
    assert (hashes != base).all()
    assert hashes.unique().numel() == len(flipped)


def test_a_bit_flip_deep_in_a_large_tensor_changes_the_hash():
    x = _tensor(3_000_000, torch.float32)
    y = x.clone()
    y.view(torch.int32)[2_345_678] ^= 1 << 7
    assert ts.ops.hash_tensors([x]).item() != ts.ops.hash_tensors([y]).item()


def test_many_threads_give_the_one_thread_hash():
    xs = [_tensor(n, torch.float32, seed=n) for n in (0, 1, 4097, 300_000, 2_000_003)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ts.ops.hash_tensors(xs)
        for threads in (2, 3, 8):
            torch.set_num_threads(threads)
            assert torch.equal(ts.ops.hash_tensors(xs), one), threads
    finally:
        torch.set_num_threads(before)


def test_tensors_on_two_devices_or_sparse_are_refused_by_name():
    with pytest.raises(ValueError, match=r"tensors\[1\] has layout"):
        ts.ops.hash_tensors([torch.ones(2), torch.ones(2).to_sparse()])
    with pytest.raises(TypeError, match=r"tensors\[0\] is int"):
        ts.ops.hash_tensors([3])
    with pytest.raises(TypeError, match="single Tensor"):
        ts.ops.hash_tensors(torch.ones(3))


def test_hash_traces_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        out = ts.ops.hash_tensors([mode.from_tensor(torch.ones(3)), mode.from_tensor(torch.ones(5, 2))])
    assert out.shape == (2,) and out.dtype == torch.int64


def test_hash_on_cuda_equals_the_cpu_hash():
    if not torch.cuda.is_available() or not getattr(ts._ext._C, "with_cuda", False):
        import os

        if os.environ.get("TORCHSTRATEGIES_TEST_GPU") == "1":
            pytest.fail("TORCHSTRATEGIES_TEST_GPU=1 but no CUDA device or an extension built without CUDA")
        pytest.skip("no CUDA device / extension without CUDA")
    xs = [_tensor(n, d, seed=n) for n in (0, 1, 7, 4097, 3_000_001) for d in (torch.float32, torch.bfloat16)]
    xs.append(_tensor(4096, torch.float32)[1:])   # an address 4 bytes past an 8-byte boundary
    on_gpu = ts.ops.hash_tensors([x.cuda() for x in xs])
    assert on_gpu.device.type == "cuda"
    assert on_gpu.cpu().tolist() == ts.ops.hash_tensors(xs).tolist()


@pytest.mark.timeout(120)
def test_the_plain_loop_gives_the_same_hash_as_the_vectorized_one():
    # CPUs without AVX2 and the CUDA kernel run hash.h's plain XXH3 loop; TORCHSTRATEGIES_HASH_SCALAR=1 makes this
    # CPU run it too (read once per process, so in a fresh one).
    import json
    import os
    import subprocess
    import sys

    sizes = [0, 1, 7, 8, 16, 17, 240, 241, 1023, 1024, 1025, 4096, 4097, 2 * 4096 * 512 + 3]
    code = ("import json, sys, torch, torchstrategies as ts\n"
            "out = []\n"
            "for n in json.loads(sys.argv[1]):\n"
            "    t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))\n"
            "    out.append(ts.ops.hash_tensors([t]).item())\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, "TORCHSTRATEGIES_HASH_SCALAR": "1"}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(sizes)], env=env, capture_output=True, text=True,
                         timeout=100, check=True)
    plain = json.loads(run.stdout.strip().splitlines()[-1])
    for n, h in zip(sizes, plain):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert h == ts.ops.hash_tensors([t]).item() == ref.hash_bytes(bytes(t.tolist())), n
