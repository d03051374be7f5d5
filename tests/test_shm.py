"""The C++ shared-memory protocol (torchstrategies._C.ShmComm) driven by threads of one process.

Each thread is one "rank" with its own mapping of the segment; the C++ calls release the GIL, so the
threads really run the protocol concurrently. A 4 KiB staging slot makes small tensors cross many
chunk boundaries, so the chunked reduce-scatter / all-gather is exercised without big data.
"""

from __future__ import annotations

import glob
import os
import secrets
import threading

import pytest
import torch

from torchstrategies._ext import _C

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")  # tests/conftest.py

SUM, MEAN, MIN, MAX = 0, 1, 2, 3


def _comms(world: int, slot_bytes: int = 4096) -> list:
    name = f"/torchstrat_test_{os.getpid()}_{secrets.token_hex(4)}"
    comms = [_C.ShmComm(name, 0, world, slot_bytes, True)]
    comms += [_C.ShmComm(name, r, world, slot_bytes, False) for r in range(1, world)]
    _threads(comms, lambda r, c: c.attach(10.0))
    assert not glob.glob(f"/dev/shm{name}*"), "the segment must be unlinked once every rank mapped it"
    return comms


def _threads(comms, fn):
    errors, results = {}, {}

    def run(r, c):
        try:
            results[r] = fn(r, c)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    ts = [threading.Thread(target=run, args=(r, c)) for r, c in enumerate(comms)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a rank thread hung"
    return results, errors


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_and_one_shot_all_reduce_match_float64_reference(world):
    comms = _comms(world)
    for c in comms:
        c.one_shot_bytes = 256  # larger messages take the chunked path through 4 KiB slots
    sizes = [0, 1, 63, 64, 1000, 1025, 3 * 1024 + 7, 10_001]
    for op in (SUM, MEAN, MIN, MAX):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
            if op == MEAN and not dtype.is_floating_point:
                continue
            for n in sizes:
                xs = [(torch.randn(n, dtype=torch.float64) * 50).to(dtype) for _ in range(world)]
                stack = torch.stack([x.to(torch.float64) for x in xs])
                ref = {SUM: stack.sum(0), MEAN: stack.mean(0), MIN: stack.min(0).values if n else stack.sum(0),
                       MAX: stack.max(0).values if n else stack.sum(0)}[op]
                bufs = [x.clone() for x in xs]
                _, errors = _threads(comms, lambda r, c: c.all_reduce_(bufs[r], op, 10.0))
                assert not errors, errors
                tol = 0.05 * world if dtype is torch.bfloat16 else 1e-4
                for b in bufs:
                    assert torch.equal(b, bufs[0]), "ranks must hold identical bits"
                    assert torch.allclose(b.to(torch.float64), ref, atol=tol, rtol=tol), (op, dtype, n)


def test_zero_copy_buffers_broadcast_and_all_gather():
    world = 3
    comms = _comms(world)
    like = torch.empty(0)
    res, errors = _threads(comms, lambda r, c: c.alloc_buffer(5000, like, 10.0))
    assert not errors, errors
    bufs = [res[r] for r in range(world)]
    for r, b in enumerate(bufs):
        assert comms[r].in_buffer(b) and not comms[r].in_buffer(torch.ones(3))
        b.copy_(torch.arange(5000, dtype=torch.float32) * (r + 1))
    _, errors = _threads(comms, lambda r, c: c.all_reduce_(bufs[r], SUM, 10.0))
    assert not errors, errors
    for b in bufs:
        assert torch.equal(b, torch.arange(5000, dtype=torch.float32) * 6)
    xs = [torch.full((3000,), float(r)) for r in range(world)]
    _, errors = _threads(comms, lambda r, c: c.broadcast_(xs[r], 2, 10.0))
    assert not errors and all(torch.equal(x, torch.full((3000,), 2.0)) for x in xs)
    outs = [torch.empty(world * 1500) for _ in range(world)]
    _, errors = _threads(comms, lambda r, c: c.all_gather(torch.full((1500,), float(r)), outs[r], 10.0))
    assert not errors
    for o in outs:
        assert torch.equal(o, torch.arange(world).float().repeat_interleave(1500))


def test_absent_rank_times_out_naming_it_and_the_group_is_then_broken():
    comms = _comms(2)
    with pytest.raises(_C.ShmDeadlineError, match=r"ranks \[1\] did not arrive within 0.3 s") as ei:
        comms[0].all_reduce_(torch.ones(4), SUM, 0.3)
    assert ei.value.missing_ranks == [1]
    assert comms[0].broken
    # The peer that comes late sees that rank 0 gave up instead of waiting out its own timeout.
    with pytest.raises(_C.ShmDeadlineError, match="rank 0 gave up"):
        comms[1].all_reduce_(torch.ones(4), SUM, 30.0)
    with pytest.raises(RuntimeError, match="broken"):
        comms[0].all_reduce_(torch.ones(4), SUM, 1.0)


def test_mismatched_counts_raise_on_every_rank_and_the_group_keeps_working():
    comms = _comms(2)
    for c in comms:
        c.one_shot_bytes = 32  # rank 1's 11 floats take the chunked path, rank 0's 10... too: 40 / 44 bytes
    xs = [torch.ones(10), torch.ones(11)]
    _, errors = _threads(comms, lambda r, c: c.all_reduce_(xs[r], SUM, 10.0))
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, _C.ShmMismatchError) and "count 10" in str(e) and "count 11" in str(e)
    ys = [torch.full((3000,), float(r + 1)) for r in range(2)]
    _, errors = _threads(comms, lambda r, c: c.all_reduce_(ys[r], SUM, 10.0))
    assert not errors and all(torch.equal(y, torch.full((3000,), 3.0)) for y in ys)


def test_a_peer_that_dies_before_it_maps_the_segment_is_noticed_in_attach():
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # gone (and reaped): its pid answers ESRCH
    name = f"/torchstrat_test_{os.getpid()}_{secrets.token_hex(4)}"
    comm = _C.ShmComm(name, 0, 2, 4096, True)
    comm.expect_pids([os.getpid(), dead.pid])  # learnt from the set-up rows before the segment existed
    with pytest.raises(_C.ShmDeadlineError, match="died") as ei:
        comm.attach(30.0)
    assert ei.value.kind == "unavailable" and ei.value.missing_ranks == [1]
    del comm  # the creator unlinks a segment nobody else mapped (no_shm_leftovers checks)


def test_pack_into_and_unpack_from_round_trip_including_non_contiguous():
    ts = [torch.randn(3, 4), torch.randn(5, 2).t(), torch.randn(0), torch.randn(7)]
    flat = torch.empty(sum(t.numel() for t in ts))
    _C.pack_into(ts, flat)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    outs = [torch.empty_like(ts[0]), torch.empty(5, 2).t(), torch.empty(0), torch.empty(7)]
    _C.unpack_from(flat * 2, outs)
    for o, t in zip(outs, ts):
        assert torch.equal(o, t * 2)
    with pytest.raises(RuntimeError, match="dtype"):
        _C.pack_into([torch.ones(2, dtype=torch.float64)], flat)
