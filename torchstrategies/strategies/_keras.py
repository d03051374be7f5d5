"""Keras 3 (torch backend) ``fit`` / ``evaluate`` / ``predict`` under MultiWorkerMirrored, Mirrored and
CentralStorage strategies, as under tf.distribute.

A Keras model made in the scope is a ``torch.nn.Module`` whose variables are ``nn.Parameter``s, so the
strategy adopts it like any module (MWMS: rank 0's weights broadcast, trainable ones in the gradient
synchronizer; in-process: replicated), and Keras' own ``loss.backward()`` leaves in every ``.grad`` the
cross-replica sum: the one gradient path of docs/strategies.md, nothing reduced twice. This module adds
only what Keras' loop needs on top, as instance attributes of the model (its class is untouched):

* ``train_step`` / ``test_step`` receive the GLOBAL batch (every worker passes the same full data and
  ``batch_size`` is global, as under tf.distribute) and split it over the replicas, evenly, larger parts
  first (TF's rule for a partial batch). MWMS: this process runs Keras' step on its rows. In-process:
  ``strategy.run`` runs Keras' step once per replica on its rows, and the Keras optimizer's ``apply`` is a
  merge_call (one update in cross-replica context from the summed gradients, copied to every replica).
  A batch with fewer rows than replicas leaves a replica empty (0 rows): it runs the step all the same,
  and its ``compute_loss`` is 0 (Keras gives an empty tensor), weighed by its 0 rows in the loss tracker.
* The gradient of ``model.compute_loss`` is scaled by ``replica rows / global rows`` (where TF's Keras
  scales the loss for tf.distribute), so the summed gradient is the gradient of the global mean:
  ``1/num_replicas`` for an even split, as TF's Keras scales, and exact for an uneven final batch. Keras'
  own step and a custom ``train_step`` written as in Keras' guide (``compute_loss``, ``loss.backward()``,
  ``optimizer.apply``) both call it; a step that applies gradients without it raises.
* Metrics are global. MWMS: after each step a metric variable with aggregation ``"sum"`` (Keras' default
  for metric state: totals, counts) becomes its value before the step plus the cross-worker sum of what
  each worker added, ``"mean"`` ones the cross-worker mean. In-process: the replicas run one at a time on
  the model's one set of metric variables, so they add up every replica's rows. So ``history``,
  ``evaluate()`` and what callbacks see are the job's values, on every worker.
* In a train step a ``BatchNormalization`` layer normalizes with the statistics of the GLOBAL batch (one
  differentiable all-reduce of the per-channel sums, as ``ts.nn.SyncBatchNorm``), so N replicas train as
  one process with the global batch (TF's Keras uses per-replica statistics unless ``synchronized=True``,
  which Keras 3 refuses on torch). MWMS also averages floating non-trainable variables across the
  workers after each step (the buffer rule: equal on every rank between steps).
* A layer that draws random numbers (it has a ``seed_generator``: Dropout, GaussianNoise, random
  augmentation) draws them for the whole global batch, zero-padded around the replica's rows, and keeps
  its rows: the masks of one process; in-process replicas start their draw from the same random state.
* ``predict_step`` runs the whole batch (no communication): every worker gets every prediction.
* MWMS ``fit`` on a worker other than the chief gives each ``ModelCheckpoint`` a temporary directory,
  removed after ``fit`` (TF's rule: the chief writes, the others write somewhere harmless).

The files: this one attaches a model (``attach``); ``_keras_replicas.py`` holds what both kinds of strategy
share (the split of the global batch, the replica's loss, the layers that see the global batch);
``_keras_worker.py`` the MultiWorkerMirrored worker (its rows, global metrics, the chief's checkpoints);
``_keras_in_process.py`` the in-process replicas (``strategy.run``, the merged ``apply``, the same draw).
Keras is never imported in them, and never touched directly: every attribute they read or replace on a
Keras object is named and typed in ``strategies/_keras_api.py`` (the adapter), which checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from torchstrategies.distribute.distribute_lib import StrategyExtended
from torchstrategies.strategies import _keras_api as keras_api
from torchstrategies.strategies._keras_api import KerasModel
from torchstrategies.strategies._keras_in_process import KerasInProcess
from torchstrategies.strategies._keras_replicas import KerasReplicas, split_rows
from torchstrategies.strategies._keras_worker import KerasWorker

if TYPE_CHECKING:
    from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredExtended

__all__ = ["attach", "is_keras_model", "split_rows"]

_ATTACHED = "_torchstrategies_keras"


def is_keras_model(module: torch.nn.Module) -> bool:
    """Whether the Keras 3 layer ``module`` is a model (it has Keras' training loop; checked by the adapter)."""
    return keras_api.as_model(module) is not None


def attach(extended: StrategyExtended, module: torch.nn.Module, in_process: bool) -> None:
    """Makes ``model.fit`` / ``evaluate`` / ``predict`` train as one model over every replica of
    ``extended``: a MultiWorkerMirrored strategy's (``in_process=False``) or a Mirrored /
    CentralStorage one's (``in_process=True``). Idempotent."""
    model = keras_api.as_model(module)
    if model is None:
        raise TypeError(f"attach: {type(module).__name__} is not a Keras model (it has no train_step and fit)")
    if getattr(model, _ATTACHED, None) is not None:
        return
    if model.jit_compile is True:
        raise NotImplementedError(_JIT)
    worker: KerasReplicas
    if in_process:
        worker = KerasInProcess(extended, model)
    else:
        worker = KerasWorker(cast("MultiWorkerMirroredExtended", extended), model)
    overrides: list[tuple[keras_api.Overridden, object]] = [
        ("train_step", worker.train), ("test_step", worker.test), ("fit", worker.fit_), ("compile", _compile(model)),
        ("_torchstrategies_keras", worker)]
    for name, fn in overrides:
        keras_api.override(model, name, fn)


_JIT = ("jit_compile=True is not supported for a Keras model under a torchstrategies strategy (torch.compile of "
        "Keras' train step would trace the split of the batch and the replicas' communication): compile the "
        "model with jit_compile=False (Keras' default on the torch backend)")


def _compile(model: KerasModel) -> Callable[..., Any]:
    compile_ = model.compile

    def compile(*args: Any, **kwargs: Any) -> Any:
        out = compile_(*args, **kwargs)
        if model.jit_compile is True:
            raise NotImplementedError(_JIT)
        return out

    return compile
