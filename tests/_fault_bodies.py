"""Rank bodies for tests/test_collectives_mismatch.py and test_collectives_peer_faults.py (top-level so
spawn can pickle them)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


def _opts(impl: str, timeout: float):
    from torchstrategies.collectives import CommunicationOptions

    return CommunicationOptions(implementation=impl, timeout_seconds=timeout)


def _expect_value_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    except Exception as e:  # noqa: BLE001 - the test reports what else came
        return f"{type(e).__name__}: {e}"
    return "no error"


def fault_outcome(call, how: str, rank: int, victim: int, victim_pid: int, tag: str) -> tuple:
    """Runs ``call()`` on a survivor and returns (error type, message); for a SIGSTOP, rank 0 then kills the
    frozen victim once every survivor has its error (so the harness can end; the victim must not be rank 0,
    which hosts the store)."""
    from torchstrategies.errors import DeadlineExceededError, UnavailableError

    try:
        call()
        result: tuple = ("no error", "")
    except (UnavailableError, DeadlineExceededError) as e:
        result = (type(e).__name__, str(e))
    except Exception as e:  # noqa: BLE001 - reported, and the test fails on it
        result = (f"other {type(e).__name__}", str(e))
    if how == "stop":  # every survivor stays until all have their error (an exit looks like a death)
        from datetime import timedelta

        store = dist.distributed_c10d._get_default_store()
        store.set(f"{tag}/done/{rank}", "1")
        store.wait([f"{tag}/done/{r}" for r in range(victim)], timedelta(seconds=60))
        if rank == 0:
            os.kill(victim_pid, signal.SIGKILL)
    return result


def mismatches(rank: int, world: int, impl: str) -> dict:
    """Each mismatched call raises ValueError on every rank (never a crash or a silent result); a correct
    call afterwards still gives the right value."""
    from torchstrategies import collectives as C

    if impl == "GLOO":
        os.environ["TORCHSTRATEGIES_DEBUG"] = "1"  # GLOO/NCCL are checked in debug mode
    opts = _opts(impl, 30)
    cases = {
        "dtype": lambda: C.all_reduce(torch.ones(5, dtype=torch.float32 if rank == 0 else torch.float64),
                                      options=opts),
        "size": lambda: C.all_reduce(torch.ones(5 + rank), options=opts),
        "op": lambda: C.all_reduce(torch.ones(5), op="sum" if rank == 0 else "max", options=opts),
        "same_size_dtype": lambda: C.all_reduce(torch.ones(5, dtype=torch.int32 if rank == 0 else torch.float32),
                                                options=opts),
    }
    out: dict = {}
    for name, fn in cases.items():
        out[name] = _expect_value_error(fn)
        ok = C.all_reduce(torch.full((3,), float(rank + 1)), options=opts)
        out[name + "_after"] = ok.tolist()
    return out


def settings_and_debug(rank: int, world: int) -> dict:
    """Settings that differ between ranks raise ValueError on every rank when the group is made, naming the
    variable; debug mode catches a mismatch gloo would not and recovers."""
    from torchstrategies import collectives as C

    out: dict = {}
    for var, impl in (("TORCHSTRATEGIES_SHM_SLOT_BYTES", "SHM"), ("TORCHSTRATEGIES_RING_CHUNK_BYTES", "RING")):
        os.environ[var] = str((64 << 10) * (rank + 1))  # differs per rank
        g = dist.new_group([0, 1])
        out[var] = _expect_value_error(lambda g=g, impl=impl: C.all_reduce(torch.ones(3), group=g,
                                                                            options=_opts(impl, 30)))
        del os.environ[var]
        g2 = dist.new_group([0, 1])
        out[var + "_after"] = C.all_reduce(torch.full((3,), float(rank + 1)), group=g2,
                                           options=_opts(impl, 30)).tolist()

    os.environ["TORCHSTRATEGIES_DEBUG"] = "1"  # read when a group is first used
    auto = _opts("AUTO", 30)
    g = dist.new_group([0, 1])
    if rank == 0:
        out["debug"] = _expect_value_error(lambda: C.all_reduce(torch.ones(3), group=g, options=auto))
    else:
        out["debug"] = _expect_value_error(lambda: C.broadcast(torch.ones(3), 0, group=g, options=auto))
    out["debug_after_same_group"] = C.all_reduce(torch.full((3,), float(rank + 1)), group=g, options=auto).tolist()
    g2 = dist.new_group([0, 1])
    out["debug_after_new_group"] = C.all_reduce(torch.full((2,), float(rank + 1)), group=g2, options=auto).tolist()
    out["gloo_op"] = _expect_value_error(
        lambda: C.all_reduce(torch.ones(2), op="sum" if rank == 0 else "max", options=_opts("GLOO", 30)))
    del os.environ["TORCHSTRATEGIES_DEBUG"]
    return out


def peer_fault(rank: int, world: int, impl: str, how: str, timeout: float) -> tuple:
    """The last rank is SIGKILLed (how="kill") or SIGSTOPped ("stop") between two all-reduces; the others
    report the error they got: (type name, message)."""
    from torchstrategies import collectives as C

    opts = _opts(impl, timeout)
    C.all_reduce_(torch.ones(1000), options=opts)  # set-up (segments, rings) done while all are alive
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    victim = world - 1
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(120)
    return fault_outcome(lambda: C.all_reduce_(torch.ones(1000), options=opts), how, rank, victim, pids[victim],
                         "fault_test")


def segment_then_signal(name: str, how: str) -> None:
    """Creates a segment as rank 0 of 2 (never attached), then exits normally or is SIGTERMed."""
    from torchstrategies._ext import _C

    _KEEP.append(_C.ShmComm(name, 0, 2, 4096, True))  # alive until the interpreter exits
    assert os.path.exists("/dev/shm" + name)
    if how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)


_KEEP: list = []


# ---- issue 27, items 4-7 (through the public API, so each test runs unchanged against older builds) --------
def _file_barrier(tmp: str, rank: int, ranks: list[int], seconds: float = 60.0) -> None:
    """Waits until every rank in ``ranks`` has reached this point (files: the store may be frozen)."""
    open(os.path.join(tmp, f"done{rank}"), "w").close()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(tmp, f"done{r}")) for r in ranks):
        time.sleep(0.05)


def frozen_store_host(rank: int, world: int, impl: str, timeout: float, tmp: str) -> tuple:
    """Rank 0 (which hosts the c10d store) is SIGSTOPped after a first all-reduce; the others report what
    the next one raised and after how long; then rank 1 kills rank 0."""
    from torchstrategies import collectives as C

    opts = _opts(impl, timeout)
    C.all_reduce_(torch.ones(10), options=opts)  # set up while everyone is alive
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    t0 = time.monotonic()
    try:
        C.all_reduce_(torch.ones(10), options=opts)
        result: tuple = ("no error", "", 0.0)
    except Exception as e:  # noqa: BLE001 - reported
        result = (type(e).__name__, str(e), time.monotonic() - t0)
    _file_barrier(tmp, rank, list(range(1, world)))
    if rank == 1:
        os.kill(pids[0], signal.SIGKILL)
    return result


def mismatched_collectives(rank: int, world: int, impl: str) -> dict:
    """The last rank calls broadcast / all_gather / a different all-reduce while the others call all_reduce:
    ValueError on every rank, and the group still works afterwards."""
    from torchstrategies import collectives as C

    opts = _opts(impl, 8)
    C.all_reduce(torch.ones(4), options=opts)  # set up first
    odd = rank == world - 1
    others = {
        "broadcast": lambda: C.broadcast(torch.ones(4), 0, options=opts),
        "all_gather": lambda: C.all_gather(torch.ones(4), options=opts),
        "all_reduce_max": lambda: C.all_reduce(torch.ones(4), op="max", options=opts),
    }
    out: dict = {}
    for name, other in others.items():
        out[name] = _expect_value_error(other if odd else lambda: C.all_reduce(torch.ones(4), options=opts))
        out[name + "_after"] = C.all_reduce(torch.full((3,), float(rank + 1)), options=opts).tolist()
    return out


def ring_set_up_by_one_rank(rank: int, world: int) -> dict:
    """Rank 0 alone starts a RING all-reduce on the world (its first RING call there: it sets up a backend,
    and times out within the call's 3 s, not the world's 60); afterwards both ranks use RING on new groups."""
    from torchstrategies import collectives as C

    out: dict = {}
    if rank == 0:
        try:
            C.all_reduce(torch.ones(3), options=_opts("RING", 3))
            out["alone"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks the type and the message
            out["alone"] = f"{type(e).__name__}: {e}"
    else:  # out of the barrier for rank 0's 3 s: a set-up that waited the world's 60 s still meets rank 1 in it
        time.sleep(3)
    dist.barrier()
    for k in range(2):
        g = dist.new_group([0, 1])
        out[f"new_group_{k}"] = C.all_reduce(torch.full((3,), float(rank + 1)), group=g,
                                             options=_opts("RING", 20)).tolist()
    return out


def debug_on_one_rank(rank: int, world: int) -> dict:
    """TORCHSTRATEGIES_DEBUG is set on rank 0 only (by the test's environment)."""
    from torchstrategies import collectives as C

    return {impl: _expect_value_error(lambda impl=impl: C.all_reduce(torch.ones(3), options=_opts(impl, 20)))
            for impl in ("GLOO", "AUTO")}
