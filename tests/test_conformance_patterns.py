"""Issue 46's common patterns in the conformance matrix: each equals plain torch on one device with the
global batch (float64, 1e-9) or raises its named error, in Mirrored(2), Mirrored(3), CentralStorage and
MultiWorkerMirrored with 2 and 3 processes (one launch per size runs every workload). Workloads:
tests/_conformance_patterns.py; docs/strategies.md's conformance matrix has a row for each.
"""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests import _conformance_patterns as P
from tests.harness import run_ranks

STRATEGIES = {
    "one_device": lambda: ts.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
}
IN_PROCESS = [w for w in P.WORKLOADS if w != "frozen_on_one_replica"]  # (one parameter object: one flag)
TOL = {"rtol": 1e-9, "atol": 1e-12}
_reference_cache: dict[str, dict[str, torch.Tensor]] = {}


def reference(workload: str) -> dict[str, torch.Tensor]:
    if workload not in _reference_cache:
        _reference_cache[workload] = P.train(workload, P.Runner(None))
    return _reference_cache[workload]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{what}: {k}: {m}", **TOL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("workload", IN_PROCESS)
def test_in_process_strategy_matches_one_device_or_names_the_pattern(workload, strategy_name):
    strategy = STRATEGIES[strategy_name]()
    if workload in P.ERRORS and strategy.num_replicas_in_sync > 1:
        kind, text = P.ERRORS[workload]
        with pytest.raises(kind, match=_literal(text)):
            P.train(workload, P.Runner(strategy))
        return
    assert_same(P.train(workload, P.Runner(strategy)), reference(workload), f"{workload}/{strategy_name}")


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def _mwms_body(rank: int, world: int) -> dict[str, object]:
    import torchstrategies as ts
    from tests import _conformance_patterns as P

    strategy = ts.MultiWorkerMirroredStrategy()
    out: dict[str, object] = {}
    try:
        for workload in P.WORKLOADS:
            try:
                # the garbage collector runs on rank 1 only, as it may in any process
                state = P.train(workload, P.Runner(strategy, collect=rank == 1))
            except Exception as e:  # noqa: BLE001 - the named errors are what some cells expect
                out[workload] = ("error", type(e).__name__, str(e))
                if workload not in P.MW_ERRORS:
                    break  # the ranks may be out of step after an unexpected error
                strategy.shutdown()
                strategy = ts.MultiWorkerMirroredStrategy()  # a fresh group after a failed collective
                continue
            out[workload] = ("state", {k: (v.tolist(), str(v.dtype)) for k, v in state.items()})
    finally:
        strategy.shutdown()
    return out


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=getattr(torch, d.split(".")[1])) for k, (v, d) in state.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_multi_worker_mirrored_matches_one_device_or_names_the_pattern(world):
    ranks = run_ranks(_mwms_body, world, timeout=540)
    failures = []
    for workload in P.WORKLOADS:
        try:
            results = [r.get(workload) for r in ranks]
            if workload in P.MW_ERRORS:
                kind, text = P.MW_ERRORS[workload]
                assert all(r is not None and r[0] == "error" for r in results), results
                assert any(r[1] == kind.__name__ and text in r[2] for r in results), results
                continue
            assert all(r is not None and r[0] == "state" for r in results), results
            states = [_tensors(r[1]) for r in results]
            for s in states[1:]:
                assert_same(s, states[0], workload)  # every rank holds the same model
            assert_same(states[0], reference(workload), workload)
        except AssertionError as e:
            failures.append(f"{workload}: {str(e)[:600]}")
    assert not failures, "\n".join(failures)


def _train_with_own_scheduler(scheduler_class: type) -> tuple[int, float]:
    """Two steps under Mirrored(3) with ``scheduler_class`` stepped in the step; its epoch and the lr."""
    strategy = ts.MirroredStrategy(num_replicas=3)
    with strategy.scope():
        model = torch.nn.Linear(2, 1).double()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = scheduler_class(opt)  # (its constructor's first step: outside run, once)

    def step_fn(x: torch.Tensor) -> None:
        opt.zero_grad()
        ts.compute_average_loss(model(x).sum(1), global_batch_size=6).backward()
        opt.step()
        sched.step()

    for _ in range(2):
        strategy.run(step_fn, args=P.Runner(strategy).split(torch.ones(6, 2, dtype=torch.float64)))
    return sched.last_epoch, opt.param_groups[0]["lr"]


@pytest.mark.timeout(120)
def test_a_scheduler_class_defined_while_a_strategy_lives_steps_once_per_step_and_is_restored():
    import gc

    holder = ts.MirroredStrategy(num_replicas=2)  # the in-process patches are installed from here on

    class Halving(torch.optim.lr_scheduler.LRScheduler):  # a step of its own that never calls the base one
        def step(self, epoch: int | None = None) -> None:
            self.last_epoch += 1
            for group in self.optimizer.param_groups:
                group["lr"] *= 0.5

    own_step = Halving.__dict__["step"].__wrapped__  # wrapped when the class was made
    assert _train_with_own_scheduler(Halving) == (2, 0.125)  # 1 + one step per training step, not per replica
    del holder
    gc.collect()
    assert Halving.__dict__["step"] is own_step
    assert "__init_subclass__" not in vars(torch.optim.lr_scheduler.LRScheduler)
