"""What a parameter-server task holds and does: variable shards, optimizers over them, pulls and pushes.

Each shard is an ``nn.Parameter`` keyed by ``"<var_id>/<shard>"``. A push carries the gradients one worker
computed for one ``optimizer.step()``; the ps sets them as ``.grad`` of its shards and steps its optimizer
over those shards, under a lock (pushes from different workers are applied one after another, in arrival
order: asynchronous training). Row pushes (touched rows of an embedding) become a sparse COO gradient when
the embedding was built with ``sparse=True``, otherwise a dense gradient that is zero outside those rows, so
the optimizer sees exactly what it would see in single-device training.

Requests arrive already authenticated (``transport.py``). Only CreateOptimizer and SetHparams carry pickled
data (the optimizer class and hyperparameters) and only the chief may call them; tensors and every other
header field travel in the :mod:`wire` schema.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
from typing import Any

import torch

__all__ = ["ParameterStore"]

log = logging.getLogger("torchstrategies.parameter_server")


class ParameterStore:
    """The state of one ps task (thread-safe)."""

    def __init__(self) -> None:
        self.vars: dict[str, torch.nn.Parameter] = {}
        self.sparse: dict[str, bool] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.lock = threading.Lock()
        self.version = 0
        self.pushes = 0

    # ---- dispatch ------------------------------------------------------------------------------
    def handle(self, header: dict, tensors: list[torch.Tensor], encode) -> tuple[dict, Any]:
        """Runs one request; ``encode(reply, tensors) -> bytes`` makes this request's whole reply (a pull
        encodes its values under the lock with it)."""
        op = header["op"]
        if op == "pull":
            return self._op_pull(header, encode)
        fn = getattr(self, "_op_" + op, None)
        if fn is None:
            raise ValueError(f"parameter server: unknown request {op!r}")
        return fn(header, tensors)

    # ---- variables -----------------------------------------------------------------------------
    def _op_create(self, h: dict, tensors: list[torch.Tensor]):
        with self.lock:
            for key, sparse, requires_grad, t in zip(h["keys"], h["sparse"], h["requires_grad"], tensors):
                self.vars[key] = torch.nn.Parameter(t.clone(), requires_grad=requires_grad)
                self.sparse[key] = bool(sparse)
        return {}, []

    def _update(self, h: dict, tensors: list[torch.Tensor], how) -> tuple[dict, list]:
        """``how(shard, value)`` for each key under the lock (an assignment, addition or subtraction)."""
        with self.lock:
            for key, t in zip(h["keys"], tensors):
                how(self._var(key).data, t)
            self.version += 1
        return {"version": self.version}, []

    _op_assign = functools.partialmethod(_update, how=torch.Tensor.copy_)
    _op_assign_add = functools.partialmethod(_update, how=torch.Tensor.add_)
    _op_assign_sub = functools.partialmethod(_update, how=torch.Tensor.sub_)

    def _op_pull(self, h: dict, encode):
        with self.lock:  # encoded here, under the lock: one copy of the values, never a torn one
            values = [self._var(k).detach() for k in h["keys"]]
            return {}, encode({"version": self.version}, values)

    def _op_pull_rows(self, h: dict, tensors: list[torch.Tensor]):
        with self.lock:
            out = [self._var(k).detach().index_select(0, ids) for k, ids in zip(h["keys"], tensors)]
            return {"version": self.version}, out

    def _var(self, key: str) -> torch.nn.Parameter:
        try:
            return self.vars[key]
        except KeyError:
            raise KeyError(f"parameter server holds no variable shard {key!r}") from None

    # ---- optimizers ----------------------------------------------------------------------------
    def _op_create_optimizer(self, h: dict, tensors: list[torch.Tensor]):
        cls = pickle.loads(h["cls"])            # chief-only method (checked before the request was read)
        groups = []
        for hyper, keys in pickle.loads(h["groups"]):
            if keys:
                groups.append({**hyper, "params": [self._var(k) for k in keys]})
        with self.lock:
            if groups:
                self.optimizers[h["oid"]] = cls(groups)
        return {}, []

    def _op_set_hparams(self, h: dict, tensors: list[torch.Tensor]):
        with self.lock:
            opt = self.optimizers.get(h["oid"])
            if opt is not None:
                live = [g for g in pickle.loads(h["groups"]) if g[1]]     # chief-only method
                for group, (hyper, _keys) in zip(opt.param_groups, live):
                    group.update(hyper)
        return {}, []

    def _op_push(self, h: dict, tensors: list[torch.Tensor]):
        """Applies one worker's gradients: ``entries`` are (key, kind) with kind "dense" (one tensor) or
        "rows" (two tensors: int64 row ids local to the shard, and the rows' gradients)."""
        it = iter(tensors)
        with self.lock:
            opt = self.optimizers.get(h["oid"])
            if opt is None:
                raise KeyError(f"parameter server holds no optimizer {h['oid']} (was it created under scope()?)")
            touched = []
            for key, kind in h["entries"]:
                p = self._var(key)
                if kind == "dense":
                    g = next(it)
                    if g.shape != p.shape:
                        raise ValueError(f"gradient for {key!r} has shape {tuple(g.shape)}, "
                                         f"the variable {tuple(p.shape)}")
                    grad = g.to(p.dtype)
                else:
                    ids, rows = next(it), next(it)
                    if self.sparse.get(key, False):
                        grad = torch.sparse_coo_tensor(ids.unsqueeze(0), rows.to(p.dtype), p.shape).coalesce()
                    else:
                        grad = torch.zeros_like(p).index_add_(0, ids, rows.to(p.dtype))
                p.grad = grad if p.grad is None else p.grad + grad
                touched.append(p)
            try:
                opt.step()
            finally:
                for p in touched:
                    p.grad = None
            self.version += 1
            self.pushes += 1
            return {"version": self.version}, []

    def _op_stats(self, h: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[Any]]:
        with self.lock:
            return {"version": self.version, "pushes": self.pushes,
                    "vars": {k: tuple(v.shape) for k, v in self.vars.items()}}, []
