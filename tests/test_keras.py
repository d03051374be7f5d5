"""Issue 37: Keras 3 (torch backend) ``fit`` / ``evaluate`` / ``predict`` under the strategies, as under
tf.distribute. ``batch_size`` is global, every worker passes the same arrays, the strategy splits each
global batch; weights, ``history`` and ``evaluate()`` equal one process on the same global batches
(float32, 1e-5). Workloads: tests/_keras_bodies.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.harness import run_ranks

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip(
    "keras", reason="keras is not installed or does not import (pip install torchstrategies[keras])",
    exc_type=ImportError)
if keras.backend.backend() != "torch":
    pytest.skip(f"keras runs on the {keras.backend.backend()!r} backend, not torch", allow_module_level=True)

import torchstrategies as ts  # noqa: E402
from tests import _keras_bodies as K  # noqa: E402

TOL = 1e-5
SHARES = [K.EPOCHS * (4 * 4 + 3), K.EPOCHS * (4 * 4 + 2)]  # rows per replica: 37 in batches of 8, the last 3 + 2
_reference: dict[str, dict] = {}


def reference(kind: str) -> dict:
    if kind not in _reference:
        _reference[kind] = K.plain(kind)
    return _reference[kind]


def assert_same(got: dict, want: dict, exact: bool = False) -> None:
    tol = 0.0 if exact else TOL
    assert len(got["weights"]) == len(want["weights"])
    for i, (g, w) in enumerate(zip(got["weights"], want["weights"])):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"weight {i}")
    assert got["history"].keys() == want["history"].keys()
    for key in want["history"]:
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=tol, atol=tol, err_msg=key)
    assert got["evaluate"].keys() == want["evaluate"].keys()
    for key in want["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][key], want["evaluate"][key], rtol=tol, atol=tol, err_msg=key)
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=tol, atol=tol)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["mlp", "subclassed"])  # subclassed: built at its first batch, in fit
def test_multi_worker_fit_equals_one_process_on_the_global_batches(kind):
    want = reference(kind)
    ranks = run_ranks(K.mwms_rank, 2, args=(kind,), timeout=200)
    for got in ranks:
        assert_same(got, want)
    # every worker ran its share of every global batch: 37 rows in batches of 8 (last 5 -> 3 + 2), as the
    # replica its rank is (replica_id_in_sync_group, as in strategy.run)
    assert [r["rows"] for r in ranks] == [{rank: n} for rank, n in enumerate(SHARES)]
    assert want["rows"] == {0: K.EPOCHS * K.ROWS}
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        np.testing.assert_array_equal(a, b)  # mirrored: bit-equal on every rank


@pytest.mark.timeout(240)
def test_multi_worker_fit_with_shuffle_uses_the_same_global_batches_on_every_worker():
    """Keras' default shuffle=True draws the order from torch's random state; the workers' states differ
    here (seeds 100 and 101) and fit starts every worker from rank 0's, so the job equals one process
    seeded 100."""
    want = K.train(K.build("mlp"), shuffle_seed=100)
    for got in run_ranks(K.mwms_rank, 2, args=("mlp", "arrays", True), timeout=200):
        assert_same(got, want)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("source", ["loader", "generator"])
def test_multi_worker_fit_from_a_data_loader_or_a_generator_of_global_batches(source):
    want = reference("mlp")
    ranks = run_ranks(K.mwms_rank, 2, args=("mlp", source), timeout=200)
    for got in ranks:
        assert_same(got, want)
    assert [r["rows"] for r in ranks] == [{rank: n} for rank, n in enumerate(SHARES)]


@pytest.mark.timeout(240)
def test_multi_worker_fit_with_batch_norm_and_dropout_equals_one_process():
    """BatchNormalization normalizes with the global batch's statistics and Dropout draws the global
    batch's mask, so both workers together train as one process; dropout is off at evaluate/predict."""
    want = reference("bn")
    for got in run_ranks(K.mwms_rank, 2, args=("bn",), timeout=200):
        assert_same(got, want)


@pytest.mark.timeout(240)
def test_multi_worker_train_on_batch_of_numpy_global_batches_equals_one_process():
    want = K.train_on_batches(K.build("mlp"))
    for got in run_ranks(K.mwms_train_on_batch, 2, timeout=200):
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL, err_msg=f"weight {i}")


@pytest.mark.timeout(240)
def test_bench_train_compares_keras_under_mwms_with_plain_keras_in_one_run(tmp_path):
    from click.testing import CliRunner

    from torchstrategies_cli import main

    out = tmp_path / "keras.json"
    result = CliRunner().invoke(main, ["bench", "train", "--nproc", "2", "--strategy", "keras-one-process",
                                       "--strategy", "keras-mwms", "--steps", "2", "--repeats", "1",
                                       "--no-in-process", "--no-progress", "--json", str(out)])
    assert result.exit_code == 0, result.output
    import json

    rows = {r["runner"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"keras-one-process", "keras-mwms"}
    assert all(r["samples/s"] > 0 for r in rows.values())


@pytest.mark.timeout(240)
def test_model_checkpoint_writes_once_on_the_chief(tmp_path):
    chief, other = run_ranks(K.mwms_checkpoint, 2, args=(str(tmp_path),), timeout=200)
    assert chief == [str(tmp_path / "model.keras")] * 2
    assert len(other) == 2 and not any(p.startswith(str(tmp_path)) for p in other), other
    assert not any(os.path.exists(os.path.dirname(p)) for p in other)  # the scratch directory is removed


@pytest.mark.parametrize("rows,workers", [(8, 2), (5, 2), (7, 3), (2, 2)])
def test_a_global_batch_is_split_evenly_larger_parts_first(rows, workers):
    from torchstrategies.strategies._keras import split_rows

    parts = [split_rows(rows, workers, r) for r in range(workers)]
    sizes = [b - a for a, b in parts]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [a for a, _ in parts[1:]] == [b for _, b in parts[:-1]] and parts[0][0] == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["mlp", "bn", "subclassed"])
@pytest.mark.parametrize("strategy_name", ["mirrored2", "central_storage2"])
def test_in_process_replicas_fit_equals_one_process_on_the_global_batches(strategy_name, kind):
    """Keras' step runs once per replica in strategy.run on the replica's rows (counted per replica), the
    gradients are summed by backward, the optimizer applies once in a merge_call."""
    got = K.in_process(strategy_name, kind)
    assert_same(got, reference(kind))
    assert got["rows"] == dict(enumerate(SHARES))


# 34 rows in global batches of 8: the last has 2 rows, and on 3 replicas one of them gets none ([1, 1, 0]), as
# TF splits it; that replica still runs the step (its loss 0, weighed by its 0 rows) and training, the history,
# evaluate() (whose last batch is the same) and predict() equal one process.
EMPTY_ROWS = 34
EMPTY_SHARES = [K.EPOCHS * (4 * 3 + 1), K.EPOCHS * (4 * 3 + 1), K.EPOCHS * (4 * 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["mlp", "bn"])
@pytest.mark.parametrize("strategy_name", ["mirrored3", "central_storage3"])
def test_a_batch_with_fewer_rows_than_replicas_leaves_one_empty_and_fit_equals_one_process(strategy_name, kind):
    got = K.in_process(strategy_name, kind, rows=EMPTY_ROWS)
    assert_same(got, K.plain(kind, rows=EMPTY_ROWS))
    assert got["rows"] == dict(enumerate(EMPTY_SHARES))


@pytest.mark.timeout(300)
def test_a_batch_with_fewer_rows_than_workers_leaves_one_empty_and_fit_equals_one_process_under_multi_worker():
    want = K.plain("bn", rows=EMPTY_ROWS)
    ranks = run_ranks(K.mwms_rank, 3, args=("bn", "arrays", False, EMPTY_ROWS), timeout=260)
    for got in ranks:
        assert_same(got, want)
    assert [r["rows"] for r in ranks] == [{rank: n} for rank, n in enumerate(EMPTY_SHARES)]


@pytest.mark.timeout(240)
def test_a_custom_train_step_with_an_empty_replica_trains_as_one_process():
    assert_same_weights(K.custom_step("mirrored3", rows=EMPTY_ROWS), K.custom_step(None, rows=EMPTY_ROWS))


def test_a_strategy_without_keras_support_refuses_a_keras_model_naming_it_and_what_works():
    from torchstrategies.distribute.distribute_lib import StrategyExtended

    class Extended:  # a strategy with two replicas that does not override the Keras hook
        _num_replicas_in_sync = 2

        def _container_strategy(self):
            return "<SomeStrategy>"

    with pytest.raises(NotImplementedError, match=r"<SomeStrategy>.*MultiWorkerMirroredStrategy \(docs/keras.md\)"):
        StrategyExtended._on_keras_module(Extended(), K.build("mlp"))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["mlp", "bn"])
def test_one_device_strategy_keeps_plain_keras_bit_for_bit(kind):
    strategy = ts.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = K.build(kind)
    assert_same(K.train(model), K.plain(kind), exact=True)
    assert "train_step" not in vars(model)  # nothing attached


@pytest.mark.timeout(240)
def test_jit_compile_under_multi_worker_is_a_clear_error():
    for message in run_ranks(K.mwms_jit, 2, timeout=200):
        assert "jit_compile=True is not supported" in message and "jit_compile=False" in message


_custom_reference: dict[str, list] = {}


def custom_reference(kind: str) -> list:
    if kind not in _custom_reference:
        _custom_reference[kind] = K.custom_step(None, kind)
    return _custom_reference[kind]


def assert_same_weights(got: list, want: list) -> None:
    # float64, but not to 1e-9: Keras' own gradient of a batch differs from the mean of its halves' by ~1e-7
    # relative in float64, without any strategy (its loss is not exact); N times the learning rate is ~0.3.
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"weight {i}")


_NOT_COMPUTE_LOSS = "applied gradients of a loss that model.compute_loss did not compute"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored3", "central_storage2"])
def test_a_custom_train_step_as_in_keras_guide_trains_as_one_process_in_process(strategy_name):
    """Issue 46 (2): a train_step of the model's own, as Keras' torch guide writes it (compute_loss,
    loss.backward(), optimizer.apply), trains at the learning rate of one process (float64), as TF's Keras
    does: the gradient of compute_loss carries the replica's share of the global batch."""
    assert_same_weights(K.custom_step(strategy_name), custom_reference("custom_step"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_a_custom_train_step_as_in_keras_guide_trains_as_one_process_under_multi_worker(world):
    for got in run_ranks(K.mwms_custom_step, world, args=("custom_step",), timeout=200):
        assert_same_weights(got, custom_reference("custom_step"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored3", "central_storage2"])
def test_a_custom_train_step_whose_loss_is_not_from_compute_loss_is_named(strategy_name):
    assert isinstance(custom_reference("custom_loss_fn"), list)  # one process trains
    kind, message = K.custom_step(strategy_name, "custom_loss_fn")
    assert kind == "error" and _NOT_COMPUTE_LOSS in message and "self.compute_loss(" in message


@pytest.mark.timeout(240)
def test_a_custom_train_step_whose_loss_is_not_from_compute_loss_is_named_under_multi_worker():
    for kind, message in run_ranks(K.mwms_custom_step, 2, args=("custom_loss_fn",), timeout=200):
        assert kind == "error" and _NOT_COMPUTE_LOSS in message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_inside_fit_under_multi_worker_the_replica_id_is_the_rank_as_in_strategy_run(world):
    """Issue 46 (10): Keras' step runs in a replica context, as in strategy.run (TF runs it there): code in a
    layer keyed on replica_id_in_sync_group sees this worker's rank, in fit (called outside or inside the
    scope) and evaluate."""
    for rank, got in enumerate(run_ranks(K.mwms_replica_ids, world, timeout=200)):
        assert got == {"fit": [rank], "run": rank}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy_name", ["mirrored3", "central_storage2"])
def test_fit_with_gradient_accumulation_steps_trains_as_one_process(strategy_name):
    # (optimizer.iterations is a tensor computed from a variable then: the strategy read `.value` of it)
    for got, want in zip(K.accumulated(strategy_name), K.accumulated(None), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)  # Keras' float64 loss: note 12 of the matrix
