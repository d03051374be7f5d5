"""Issue 35: one gradient rule in every strategy. After ``loss.backward()`` returns inside a step every
``.grad`` is the cross-replica sum; the optimizer applies the cross-replica sum of whatever gradients it is
about to apply, never summing one twice; buffers are made equal at every optimizer step; a write in replica
context that leaves the replicas' copies different is a named error. Parity is float64 against plain torch
on one device with the global batch, to 1e-9 (workloads: tests/_grad_rule.py)."""

from __future__ import annotations

import pytest
import torch

import torchstrategies as ts
from tests import _conformance as C
from tests import _grad_rule as G
from tests.harness import run_ranks

STRATEGIES = {
    "one_device": lambda: ts.OneDeviceStrategy("cpu"),
    "mirrored2": lambda: ts.MirroredStrategy(num_replicas=2),
    "mirrored3": lambda: ts.MirroredStrategy(num_replicas=3),
    "central_storage": lambda: ts.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu"),
}
REPLICATED = [name for name in STRATEGIES if name != "one_device"]  # where replicas can split
_reference: dict[str, dict[str, torch.Tensor]] = {}


def reference(workload: str) -> dict[str, torch.Tensor]:
    if workload not in _reference:
        _reference[workload] = G.train(workload, C.Runner(None))
    return _reference[workload]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("workload", G.PARITY)
def test_in_process_strategy_applies_the_global_gradient_like_one_device(workload, strategy_name):
    got = G.train(workload, C.Runner(STRATEGIES[strategy_name]()))
    C.assert_same(got, reference(workload), workload)


def _mwms_body(rank: int, world: int) -> dict[str, object]:
    import traceback

    import torchstrategies as ts
    from tests import _conformance as C
    from tests import _grad_rule as G

    strategy = ts.MultiWorkerMirroredStrategy()
    out: dict[str, object] = {}
    try:
        for workload in G.PARITY:
            try:
                state = G.train(workload, C.Runner(strategy))
                out[workload] = {k: v.tolist() for k, v in state.items()}
            except Exception:  # noqa: BLE001 - reported by that workload's test
                out[workload] = traceback.format_exc()[-1500:]
                strategy.extended.barrier()
    finally:
        strategy.shutdown()
    return out


@pytest.fixture(scope="module")
def mwms_results() -> list[dict[str, object]]:
    """Every workload on a 2-process MultiWorkerMirroredStrategy, one launch for all of them."""
    return run_ranks(_mwms_body, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workload", G.PARITY)
def test_multi_worker_mirrored_applies_the_global_gradient_like_one_device(workload, mwms_results):
    """Cases 1-6 of the issue (unfreeze: parameters unfrozen after the scope; assigned: gradients assigned
    to p.grad; outside_model: a model made outside the scope; running_buffer: buffers; sparse; double_after
    _scope: dtype changed after the scope) and clipping / manual updates / accumulation, on 2 processes."""
    if workload == "reentrant_checkpoint":  # a backward inside a backward: refused, as DDP does
        for r in mwms_results:
            assert "use_reentrant=False" in str(r[workload]), r[workload]
        return
    states = []
    for r in mwms_results:
        got = r[workload]
        assert isinstance(got, dict), got
        states.append({k: torch.tensor(v, dtype=torch.float64) for k, v in got.items()})
    C.assert_same(states[0], states[1], workload)  # every rank holds the same model and buffers
    C.assert_same(states[0], reference(workload), workload)


# --- named errors, in-process -------------------------------------------------------------------------------
def _run_steps(strategy, model, step, features: int = 6) -> None:
    runner = C.Runner(strategy)
    for s in range(2):
        x, y = G._data(s, features)
        runner.run(step, *runner.split(x, y))


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_an_embedding_renormalized_in_forward_per_replica_is_a_named_error(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        emb = torch.nn.Embedding(10, 3, max_norm=0.5).double()  # renormalizes the rows it looks up, in place
        opt = torch.optim.SGD(emb.parameters(), lr=G.LR)

    def step(x, y):
        opt.zero_grad()
        C.Runner(strategy).loss(emb((x.abs() * 3).long().clamp(max=9)).sum((1, 2))).backward()
        opt.step()

    with pytest.raises(ts.errors.ReplicaDivergenceError, match=r"Embedding\.weight.*merge_call"):
        _run_steps(strategy, emb, step)


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_a_manual_update_from_per_replica_values_is_a_named_error(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = G._mlp()

    def step(x, y):
        with torch.no_grad():
            model[2].bias.add_(x.mean())  # each replica's own batch: the copies split

    with pytest.raises(ts.errors.ReplicaDivergenceError, match=r"parameter Sequential\.2\.bias"):
        _run_steps(strategy, model, step)


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_an_integer_buffer_the_replicas_wrote_differently_is_a_named_error(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = G._mlp()
        model.register_buffer("seen", torch.zeros((), dtype=torch.long))
        opt = torch.optim.SGD(model.parameters(), lr=G.LR)

    def step(x, y):
        opt.zero_grad()
        model.seen.add_(int(ts.get_replica_context().replica_id_in_sync_group))
        C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
        opt.step()

    with pytest.raises(ts.errors.ReplicaDivergenceError, match=r"integer buffer Sequential\.seen"):
        _run_steps(strategy, model, step)


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_a_queue_each_replica_enqueues_its_own_keys_into_is_a_named_error(strategy_name):
    # MoCo's key queue: one device enqueues the global batch's keys; replicas each enqueue their own at the
    # same place, and no average of them is what one device holds.
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = G._mlp()
        model.register_buffer("queue", torch.zeros(8, 2, dtype=torch.float64))
        opt = torch.optim.SGD(model.parameters(), lr=G.LR)

    def step(x, y):
        opt.zero_grad()
        with torch.no_grad():
            model.queue[: x.shape[0]] = model(x)  # this replica's keys
        C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
        opt.step()

    with pytest.raises(ts.errors.ReplicaDivergenceError,
                       match=r"buffer Sequential\.queue.*declare_buffer_aggregation"):
        _run_steps(strategy, model, step)


def test_a_buffer_aggregation_is_declared_by_name_and_checked():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.register_buffer("queue", torch.zeros(3))
    model.register_buffer("count", torch.zeros((), dtype=torch.long))
    from torchstrategies.distribute.buffers import is_mean_buffer

    assert is_mean_buffer(model[1], "running_mean") and is_mean_buffer(model[1], "running_var")
    assert not is_mean_buffer(model[1], "num_batches_tracked") and not is_mean_buffer(model, "queue")
    ts.declare_buffer_aggregation(model, "queue", "mean")
    ts.declare_buffer_aggregation(model[1], "running_var", ts.VariableAggregation.NONE)
    assert is_mean_buffer(model, "queue") and not is_mean_buffer(model[1], "running_var")
    assert is_mean_buffer(model.double(), "queue")   # kept by name: .double() replaces the tensors
    with pytest.raises(ValueError, match="has no buffer 'nope'"):
        ts.declare_buffer_aggregation(model, "nope")
    with pytest.raises(ValueError, match="only a floating buffer can be averaged"):
        ts.declare_buffer_aggregation(model, "count", "mean")
    with pytest.raises(ValueError, match="MEAN or NONE"):
        ts.declare_buffer_aggregation(model, "queue", "sum")


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_replicas_stepping_different_optimizers_is_a_merge_call_mismatch(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        model = G._mlp()
        opt_a = torch.optim.SGD(model[0].parameters(), lr=G.LR)
        opt_b = torch.optim.SGD(model[2].parameters(), lr=G.LR)

    def step(x, y):
        C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
        (opt_a if ts.get_replica_context().replica_id_in_sync_group == 0 else opt_b).step()

    with pytest.raises(RuntimeError, match=r"different functions.*SGD\.step.*SGD\.step"):
        _run_steps(strategy, model, step)


@pytest.mark.parametrize("strategy_name", REPLICATED)
def test_an_optimizer_made_in_another_strategys_scope_is_an_error_in_run(strategy_name):
    other = ts.MirroredStrategy(num_replicas=2)
    with other.scope():
        model = G._mlp()
        opt = torch.optim.SGD(model.parameters(), lr=G.LR)
    strategy = STRATEGIES[strategy_name]()

    def step(x, y):
        opt.zero_grad()
        C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
        opt.step()

    with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
        _run_steps(strategy, model, step)


def test_every_replica_reads_the_global_gradient_after_backward():
    strategy = ts.MirroredStrategy(num_replicas=3)
    torch.manual_seed(0)
    with strategy.scope():
        model = G._mlp()
    x, y = G._data(0)
    torch.manual_seed(0)
    ref = G._mlp()
    C.Runner(None).loss((ref(x) - y).pow(2).sum(1)).backward()

    def step(x, y):
        C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
        return [p.grad.clone() for p in model.parameters()]

    runner = C.Runner(strategy)
    grads = strategy.run(step, args=runner.split(x, y))
    for i, p in enumerate(ref.parameters()):
        for g in strategy.experimental_local_results(grads[i]):
            torch.testing.assert_close(g, p.grad, rtol=1e-9, atol=1e-12)


# --- named errors, MultiWorkerMirrored -----------------------------------------------------------------------
def _mwms_integer_buffer(rank: int, world: int) -> str:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = torch.nn.Linear(2, 1).double()
            model.register_buffer("seen", torch.zeros((), dtype=torch.long))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.seen.add_(rank)
        model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        try:
            opt.step()
        except ts.errors.ReplicaDivergenceError as e:
            return str(e)
        return "no error"
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_multi_worker_integer_buffer_that_ranks_wrote_differently_is_a_named_error():
    for message in run_ranks(_mwms_integer_buffer, 2, timeout=90):
        assert "Linear.seen" in message, message


def _mwms_queue(rank: int, world: int) -> dict[str, str]:
    import torchstrategies as ts

    strategy = ts.MultiWorkerMirroredStrategy()
    out = {}
    try:
        with strategy.scope():
            model = torch.nn.Linear(2, 1).double()
            model.register_buffer("queue", torch.zeros(4, dtype=torch.float64))   # undeclared
            model.register_buffer("baseline", torch.zeros(1, dtype=torch.float64))
            ts.declare_buffer_aggregation(model, "baseline", "mean")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for name in ("baseline", "queue"):
            getattr(model, name).fill_(float(rank))   # each rank its own value
            model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
            try:
                opt.step()
                out[name] = f"no error, {getattr(model, name).tolist()}"
            except ts.errors.ReplicaDivergenceError as e:
                out[name] = str(e)
        return out
    finally:
        strategy.shutdown()


@pytest.mark.timeout(120)
def test_multi_worker_buffer_declared_mean_is_averaged_and_an_undeclared_one_that_differs_is_named():
    for out in run_ranks(_mwms_queue, 2, timeout=90):
        assert out["baseline"] == "no error, [0.5]", out    # (0 + 1) / 2 on every rank
        assert "buffer Linear.queue differs between the ranks" in out["queue"], out
        assert "declare_buffer_aggregation" in out["queue"], out


# --- MultiWorkerMirrored's divergence check --------------------------------------------------------------
def _mwms_divergence(rank: int, world: int, every: int) -> list[str]:
    import tempfile

    import torchstrategies as ts
    from torchstrategies.checkpoint import Checkpoint

    strategy = ts.MultiWorkerMirroredStrategy()
    out = []
    try:
        strategy.extended.agreement.step.slices = every
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        path = tempfile.mkdtemp() + "/ckpt.pt"
        Checkpoint(model=model).save(path)  # same everywhere: passes
        for step in range(4):
            if step == 2 and rank == 1:
                with torch.no_grad():
                    model[1].bias.add_(1.0)  # rank 1 alone: the ranks split silently
            model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
            try:
                opt.step()
            except ts.errors.ReplicaDivergenceError as e:
                out.append(str(e))
                break
        if not out:
            try:
                Checkpoint(model=model).save(path)
            except ts.errors.ReplicaDivergenceError as e:
                out.append(str(e))
    finally:
        strategy.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every,when", [(1, "optimizer step 3"), (0, "checkpoint save")])
def test_multi_worker_divergence_check_names_the_first_differing_parameter_and_the_step(every, when):
    for messages in run_ranks(_mwms_divergence, 2, args=(every,), timeout=90):
        assert len(messages) == 1 and "Sequential.1.bias" in messages[0] and when in messages[0], messages


# --- MultiWorkerMirrored: the conformance matrix's per-rank writes (its "error (5)" cells) -----------------
def _mwms_per_rank_writes(rank: int, world: int) -> dict[str, object]:
    """Two workloads the in-process strategies name in their merge: a parameter written from each rank's own
    values in the step, and ranks stepping different optimizers. Each rank's own batch; 12 steps at most."""
    import torchstrategies as ts

    out: dict[str, object] = {}
    for case in ("manual", "optimizers"):
        strategy = ts.MultiWorkerMirroredStrategy()
        try:
            with strategy.scope():
                torch.manual_seed(0)
                model = G._mlp()
                opt_a = torch.optim.SGD(model[0].parameters(), lr=G.LR)
                opt_b = torch.optim.SGD(model[2].parameters(), lr=G.LR)
            out[case] = None
            for step in range(1, 13):
                x, y = G._data(10 * step + rank)
                model.zero_grad()
                C.Runner(strategy).loss((model(x) - y).pow(2).sum(1)).backward()
                try:
                    if case == "manual":
                        with torch.no_grad():
                            model[2].bias.add_(x.mean())   # each rank's own batch: the copies split
                        opt_a.step()
                    else:
                        (opt_a if rank == 0 else opt_b).step()
                except ts.errors.ReplicaDivergenceError as e:
                    out[case] = {"step": step, "tensor": e.tensor, "message": str(e)}
                    break
        finally:
            strategy.shutdown()
    return out


@pytest.mark.timeout(150)
def test_multi_worker_per_rank_writes_and_ranks_stepping_different_optimizers_are_named():
    for out in run_ranks(_mwms_per_rank_writes, 2, timeout=120):
        manual, optimizers = out["manual"], out["optimizers"]
        assert manual is not None and manual["step"] == 1, out                   # a counted write: at once
        assert manual["tensor"] == "Sequential.2.bias", out
        assert optimizers is not None and optimizers["step"] <= 1 + 10, out      # the rotating slice's bound
        assert "differs between the ranks" in optimizers["message"], out
        assert "ranks that step different optimizers" in optimizers["message"], out
