"""The conformance matrix: ordinary PyTorch 2 training code under every strategy equals plain torch on one
device with the same global batch (float64 to 1e-9, float32 to 1e-5), for both ``zero_grad`` orders.

Strategies: OneDevice, Mirrored with 2 and 3 replicas, CentralStorage (2 compute devices), and
MultiWorkerMirrored with 2 processes (one launch runs every workload). Workloads: tests/_conformance.py.
docs/strategies.md carries the same matrix as a table, with the reason for each cell that differs.
"""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests import _conformance as C
from tests.harness import run_ranks

STRATEGIES = {
    "one_device": lambda: ts.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
}
ORDERS = ("before", "after")
_reference_cache: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def reference(workload: str, order: str) -> dict[str, torch.Tensor]:
    key = (workload, order)
    if key not in _reference_cache:
        _reference_cache[key] = C.train(workload, C.Runner(None), order)
    return _reference_cache[key]


def _equal_to_one_device_expected(workload: str, replicas: int) -> bool:
    # BatchNorm in train mode normalizes each replica's slice with that slice's statistics: N > 1 replicas
    # cannot equal one device (ts.nn.SyncBatchNorm is the layer that does).
    return not (workload == "conv_bn" and replicas > 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("workload", C.WORKLOADS)
def test_in_process_strategy_matches_one_device(workload, strategy_name, order):
    strategy = STRATEGIES[strategy_name]()
    got = C.train(workload, C.Runner(strategy), order)
    ref = reference(workload, order)
    if _equal_to_one_device_expected(workload, strategy.num_replicas_in_sync):
        C.assert_same(got, ref, workload)
    else:
        assert C.max_difference(got, ref) > 1e-6  # the documented deviation is real, not a tolerance


def _mwms_body(rank: int, world: int) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    import torchstrategies as ts
    from tests import _conformance as C

    strategy = ts.MultiWorkerMirroredStrategy()
    out = {}
    try:
        for workload in C.WORKLOADS:
            for order in ("before", "after"):
                state = C.train(workload, C.Runner(strategy), order)
                # plain Python values: tensors in the result queue would need the process to stay alive
                out[(workload, order)] = {k: (v.tolist(), str(v.dtype)) for k, v in state.items()}
        state = _compiled_step_training(strategy, compiled=True)  # a compiled step function: MWMS's own case
        out[("compiled_step", "before")] = {k: (v.tolist(), str(v.dtype)) for k, v in state.items()}
    finally:
        strategy.shutdown()
    return out


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=getattr(torch, d.split(".")[1])) for k, (v, d) in state.items()}


@pytest.mark.timeout(600)
def test_multi_worker_mirrored_two_processes_match_one_device():
    results = run_ranks(_mwms_body, 2, timeout=540)
    failures = []
    for (workload, order), got in results[0].items():
        got, other = _tensors(got), _tensors(results[1][(workload, order)])
        try:
            if workload == "compiled_step":  # (float32: the tolerance of "compile")
                C.assert_same(got, other, "compile")
                C.assert_same(got, _compiled_step_training(None, compiled=False), "compile")
            elif _equal_to_one_device_expected(workload, 2):
                C.assert_same(got, other, workload)  # both ranks hold the same model
                C.assert_same(got, reference(workload, order), workload)
            else:
                assert C.max_difference(got, reference(workload, order)) > 1e-6
        except AssertionError as e:
            failures.append(f"{workload}/{order}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)


def _compiled_step_training(strategy, compiled: bool, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` steps of a step function wrapped in ``torch.compile`` (``compiled``) or not, under ``strategy``
    (None: plain torch on the global batch), float32."""
    import torchstrategies as ts
    from tests import _conformance as C

    runner = C.Runner(strategy)
    torch.manual_seed(0)
    with runner.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        per_example = (model(x) - y).pow(2).sum(1)
        loss = per_example.sum() / 8 if strategy is None else ts.compute_average_loss(per_example, global_batch_size=8)
        loss.backward()
        opt.step()  # in-process: a merge_call; MultiWorkerMirrored: its pre-hook's collectives (graph breaks)

    fn = torch.compile(step) if compiled else step
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        runner.run(fn, *runner.split(x, y))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_a_compiled_step_function_under_mirrored_equals_the_eager_one():
    got = _compiled_step_training(ts.MirroredStrategy(num_replicas=2), compiled=True)
    C.assert_same(got, _compiled_step_training(None, compiled=False), "compile")  # float32 tolerance


@pytest.mark.timeout(300)
def test_a_compiled_step_function_under_mirrored_does_not_recompile_at_every_step():
    # The merge's bookkeeping (which piece of the rotating slice, which tensors moved) changes every step: traced
    # by dynamo, it recompiled at every step until dynamo's recompile limit (8) and warned. It runs eagerly.
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("torch._dynamo")
    handler = Keep(level=logging.WARNING)
    log.addHandler(handler)
    try:
        got = _compiled_step_training(ts.MirroredStrategy(num_replicas=2), compiled=True, steps=12)
    finally:
        log.removeHandler(handler)
    assert not [r for r in records if "recompile" in r], records[:3]
    C.assert_same(got, _compiled_step_training(None, compiled=False, steps=12), "compile")
