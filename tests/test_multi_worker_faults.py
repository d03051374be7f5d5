"""A worker that dies or hangs makes the others raise a named error within the timeout, never hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.harness import run_ranks


def _victim_body(rank, world, impl, how, timeout_s):
    from torchstrategies import CommunicationOptions
    from torchstrategies.errors import DeadlineExceededError, UnavailableError
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    # The strategy initializes the process group itself (the harness did not), with our timeout.
    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(implementation=impl, timeout_seconds=timeout_s))
    with strategy.scope():
        model = torch.nn.Linear(32, 4)  # no torch.optim: its first use imports torch._dynamo (seconds)
    x = torch.randn(8, 32)
    import torch.distributed as dist

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    for step in range(1000):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            model(x).pow(2).mean().backward()  # returns with reduced gradients (or raises)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        except (UnavailableError, DeadlineExceededError) as exc:
            if how == "stop":
                os.kill(pids[1], signal.SIGKILL)  # clean up the frozen worker
            return type(exc).__name__, str(exc), step
    return "no error", "", 1000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", ["AUTO", "GLOO"])
def test_sigkill_of_one_worker_raises_a_named_error_on_the_others(impl):
    results = run_ranks(_victim_body, 2, args=(impl, "kill", 10.0), init_process_group=False, timeout=50,
                        expect_failure=[1])
    kind, message, step = results[0]
    assert kind in ("UnavailableError", "DeadlineExceededError"), (kind, message)
    assert "[1]" in message, message
    assert step == 3, step  # the first step after the death failed, later ones never ran


@pytest.mark.timeout(60)
def test_a_hung_worker_raises_deadline_exceeded_naming_it():
    results = run_ranks(_victim_body, 2, args=("AUTO", "stop", 3.0), init_process_group=False, timeout=50,
                        expect_failure=[1])
    kind, message, step = results[0]
    assert kind == "DeadlineExceededError", (kind, message)
    assert "[1]" in message, message  # names the hung rank
    assert step == 3, step  # within the timeout of the first step after the freeze


def _shutdown_body(rank, world):
    import gc
    import weakref

    import torch.distributed as dist

    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

    strategy = MultiWorkerMirroredStrategy()  # makes the process group itself
    with strategy.scope():
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # imports torch._dynamo, as user code does
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    strategy.reduce("sum", torch.tensor(1.0), axis=None)
    world_ref = weakref.ref(dist.group.WORLD)
    strategy.shutdown()
    gc.collect()
    return {"initialized": dist.is_initialized(), "group_alive": world_ref() is not None}


@pytest.mark.timeout(90)
def test_shutdown_frees_the_process_group_it_made_even_after_an_optimizer_imported_dynamo():
    # A gloo group that outlives shutdown keeps its worker threads until interpreter exit, where one that
    # frees its last work item during finalization aborts the process (exit -6 under torchrun).
    for res in run_ranks(_shutdown_body, 2, init_process_group=False, timeout=80):
        assert res == {"initialized": False, "group_alive": False}
