"""The worker side: runs scheduled closures against parameters that live on the ps tasks.

A closure arrives pickled (cloudpickle) with references in place of the strategy's modules, optimizers,
parameters and per-worker iterators. The worker keeps one local replica of each module (same structure and
buffers, parameters as placeholders), and:

* before the closure runs, pulls the current value of every dense parameter the closure references
  (one request per ps);
* in ``forward``, an ``nn.Embedding`` whose table is sharded or ``sparse=True`` pulls only the rows its input
  touches (a small local leaf tensor stands in for the table);
* ``optimizer.step()`` pushes the gradients (dense tensors split by shard, or only the touched rows) to the
  ps tasks, which apply them with the optimizer; the local parameters are then marked stale and pulled again
  before the next forward, so a closure that takes several steps sees its own updates, as in single-device
  code;
* an in-place change a closure makes to a parameter (``with torch.no_grad(): w.add_(1)``) is written back
  to the ps when the closure ends (an assignment, last writer wins, as in TF).
"""

from __future__ import annotations

import contextlib
import io
import logging
import pickle
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.nn.functional as F

from torchstrategies.errors import CancelledError
from torchstrategies.parameter_server.per_worker_input import PerWorkerInputContext
from torchstrategies.parameter_server.remote_value import map_tensors
from torchstrategies.parameter_server.rpc.transport import call_abandoned
from torchstrategies.parameter_server.specs import VarSpec, split_rows
from torchstrategies.parameter_server.variables import PSVariable
from torchstrategies.parameter_server.worker_channels import PsChannels

__all__ = ["JobDefinitions", "WorkerOptimizer", "WorkerRuntime"]

log = logging.getLogger("torchstrategies.parameter_server")


class _WorkerStrategyView:
    """What ``strategy`` means inside a closure: one replica, this worker."""

    num_replicas_in_sync = 1
    cluster_resolver = None

    def scope(self):
        return contextlib.nullcontext()

    def run(self, fn, args=(), kwargs=None):
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis=None):
        if axis is None:
            return value
        op = str(getattr(reduce_op, "value", reduce_op)).lower()
        return value.sum(axis) if op == "sum" else value.float().mean(axis) if op == "mean" else value

    def experimental_local_results(self, value):
        return (value,)


def _noop_hook(*args, **kwargs):
    return None


class _RowLookup:
    """``forward`` of a worker's nn.Embedding whose table lives on the ps: pulls only the touched rows."""

    def __init__(self, runtime: WorkerRuntime, module: torch.nn.Embedding, var_id: int):
        self.runtime = runtime
        self.module = module
        self.var_id = var_id

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        m = self.module
        if m.max_norm is not None:
            raise NotImplementedError(
                "nn.Embedding(max_norm=...) with a sharded or sparse table on a ParameterServerStrategy is not "
                "supported (the renormalisation would have to be written back to the ps)"
            )
        uniq, inverse = torch.unique(input.reshape(-1), sorted=True, return_inverse=True)
        rows = self.runtime.pull_rows(self.var_id, uniq)
        leaf = rows.requires_grad_(m.weight.requires_grad and torch.is_grad_enabled())
        if leaf.requires_grad:
            self.runtime.record_rows(self.var_id, uniq, leaf)
        pad = None
        if m.padding_idx is not None:
            hit = (uniq == m.padding_idx).nonzero().reshape(-1)
            pad = int(hit[0]) if hit.numel() else None
        return F.embedding(inverse.reshape(input.shape), leaf, pad, None, m.norm_type, m.scale_grad_by_freq, False)


class WorkerOptimizer:
    """The worker's stand-in for an optimizer created under ``scope()``: ``step()`` pushes gradients.

    The optimizer's state (momentum, Adam moments) lives on the ps tasks, next to the parameters.
    """

    def __init__(self, runtime: WorkerRuntime, oid: int, groups: list[tuple[dict, list[int]]]):
        self._runtime = runtime
        self._oid = oid
        self._vids = [v for _, vids in groups for v in vids]
        self.param_groups = [{**hyper, "params": [runtime.param(v) for v in vids]} for hyper, vids in groups]
        self.defaults: dict[str, Any] = dict(groups[0][0]) if groups else {}
        self.state: dict[Any, Any] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
        for v in self._vids:
            self._runtime.clear_rows(v)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._runtime.push(self._oid, self._vids)
        return loss

    def __repr__(self) -> str:
        return f"WorkerOptimizer(oid={self._oid}, params={len(self._vids)})"


class _Unpickler(pickle.Unpickler):
    def __init__(self, blob: bytes, runtime: WorkerRuntime, pwv: list[Any] | None = None):
        super().__init__(io.BytesIO(blob))
        self._rt = runtime
        self._pwv = pwv or []

    def persistent_load(self, pid):
        kind = pid[0]
        rt = self._rt
        if kind == "param":
            rt.active.add(pid[1])
            return rt.param(pid[1])
        if kind == "module":
            return rt.module(pid[1])
        if kind == "optimizer":
            return rt.optimizer(pid[1])
        if kind == "iter":
            return rt.iterator(pid[1])
        if kind == "strategy":
            return _WorkerStrategyView()
        if kind == "nohook":
            return _noop_hook
        if kind == "variable":
            return rt.variable(pid[1])
        if kind == "pwv":
            return self._pwv[pid[1]]
        if kind == "fn":       # the scheduled function, pickled apart by the chief's FunctionCache
            return _Unpickler(pid[1], rt, self._pwv).load()
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


@dataclass
class JobDefinitions:
    """What the chief has sent this worker about the job, by id (``Registry.defs_for`` sends each once per
    connection): where each variable's shards live, each module's pickled structure and the variables it
    holds, each optimizer's param groups, each per-worker dataset's pickled ``dataset_fn`` and the dataset
    of each iterator. The objects built from them live in :class:`WorkerRuntime`."""

    specs: dict[int, VarSpec] = field(default_factory=dict)
    module_blobs: dict[int, bytes] = field(default_factory=dict)
    module_vars: dict[int, list[int]] = field(default_factory=dict)
    optimizers: dict[int, list[tuple[dict, list[int]]]] = field(default_factory=dict)
    dataset_fns: dict[int, bytes] = field(default_factory=dict)
    iter_datasets: dict[int, int] = field(default_factory=dict)

    def install(self, defs: dict) -> None:
        """Adds the definitions of one ``exec`` request (see ``Registry.defs_for`` for its keys)."""
        for spec in defs.get("vars", ()):
            self.specs[spec.var_id] = spec
        self.module_blobs.update(defs.get("modules", {}))
        self.module_vars.update(defs.get("module_vars", {}))
        self.optimizers.update(defs.get("optimizers", {}))
        self.dataset_fns.update(defs.get("datasets", {}))
        self.iter_datasets.update(defs.get("iters", {}))


class WorkerRuntime:
    """State of one worker task: what the chief sent (:class:`JobDefinitions`), the objects built from it
(parameters, module replicas, optimizers, variables, iterators), the current closure's parameters, and
the channels to the ps tasks (:class:`PsChannels`)."""

    def __init__(self, server):
        self.worker_index = server.task_id
        self.num_workers = 1
        self.ps = PsChannels(server.auth, server.timeout)
        self.defs = JobDefinitions()
        self.specs = self.defs.specs          # read on every pull and push
        self.params: dict[int, torch.nn.Parameter] = {}
        self._modules: dict[int, torch.nn.Module] = {}
        self._optimizers: dict[int, WorkerOptimizer] = {}
        self._variables: dict[int, PSVariable] = {}
        self._iterators: dict[int, Iterator[object]] = {}
        self.active: set[int] = set()
        self.stale: set[int] = set()
        self._seen_version: dict[int, int] = {}
        self._rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._pulled_bytes = 0
        self._pushed_bytes = 0

    # ---- requests from the chief ---------------------------------------------------------------
    def handle(self, header: dict, tensors) -> tuple[dict, list]:
        op = header["op"]
        if op == "setup":
            self.worker_index = header["worker_index"]
            self.num_workers = header["num_workers"]
            self.ps.setup([(str(a), str(i)) for a, i in header["ps"]], self.worker_index,
                          header.get("timeout", self.ps.timeout))
            return {}, []
        if op == "exec":
            return self._exec(header), []
        raise ValueError(f"worker: unknown request {op!r}")

    def close(self) -> None:
        self.ps.close()

    def _exec(self, header: dict) -> dict:
        """Runs one closure. Exec is a chief-only method: the interceptor checked the caller's credentials
        before the request was read, so these pickles come from the authenticated chief."""
        self.defs.install(pickle.loads(header["defs"]) if header.get("defs") else {})
        self.active = set()
        try:
            pwv = [_Unpickler(b, self).load() for b in header.get("pwv", [])]
            fn, args, kwargs = _Unpickler(header["closure"], self, pwv).load()
            self.pull(self.active)
            result = fn(*args, **kwargs)
            self._write_back_assignments()
            blob = cloudpickle.dumps(map_tensors(torch.Tensor.detach, result))
        except BaseException as exc:
            try:                  # the chief re-raises the closure's own exception (it trusts its workers)
                exc._ts_reply_extra = {"exc": _dumps_exception(exc)}  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - not picklable: the chief gets its type name and message
                pass
            raise
        return {"result": blob, "pulled_bytes": self._pulled_bytes, "pushed_bytes": self._pushed_bytes}

    # ---- references ------------------------------------------------------------------------------
    def param(self, vid: int) -> torch.nn.Parameter:
        p = self.params.get(vid)
        if p is None:
            spec = self.specs[vid]
            device = "meta" if spec.row_path else "cpu"
            p = torch.nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype, device=device),
                                   requires_grad=spec.requires_grad)
            self.params[vid] = p
        return p

    def variable(self, vid: int) -> PSVariable:
        var = self._variables.get(vid)
        if var is None:
            var = PSVariable(self.ps.call, self.specs[vid])
            self._variables[vid] = var
        return var

    def module(self, mid: int) -> torch.nn.Module:
        m = self._modules.get(mid)
        if m is None:
            m = _Unpickler(self.defs.module_blobs[mid], self).load()
            var_of = {id(self.params[v]): v for v in self.defs.module_vars.get(mid, []) if v in self.params}
            for sub in m.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    sub.register_forward_pre_hook(self._fresh_hook)
                if isinstance(sub, torch.nn.Embedding):
                    vid = var_of.get(id(sub.weight))
                    if vid is not None and self.specs[vid].row_path:
                        sub.forward = _RowLookup(self, sub, vid)  # type: ignore[method-assign]  # this replica only
            self._modules[mid] = m
        self.active.update(self.defs.module_vars.get(mid, []))
        return m

    def optimizer(self, oid: int) -> WorkerOptimizer:
        opt = self._optimizers.get(oid)
        if opt is None:
            opt = WorkerOptimizer(self, oid, self.defs.optimizers[oid])
            self._optimizers[oid] = opt
        self.active.update(v for _, vids in self.defs.optimizers[oid] for v in vids)
        return opt

    def iterator(self, iid: int):
        it = self._iterators.get(iid)
        if it is None:
            fn = pickle.loads(self.defs.dataset_fns[self.defs.iter_datasets[iid]])
            it = iter(fn(PerWorkerInputContext(self.worker_index, self.num_workers)))
            self._iterators[iid] = it
        return it

    # ---- ps traffic ------------------------------------------------------------------------------
    def pull(self, vids) -> None:
        dense = [v for v in vids if not self.specs[v].row_path]
        if not dense:
            return
        by_ps: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
        for v in dense:
            for i, sh in enumerate(self.specs[v].shards):
                by_ps[sh.ps].append((v, i, sh.key))
        replies = self.ps.fan_out({ps: ({"op": "pull", "keys": [k for _, _, k in items]}, [])
                                 for ps, items in by_ps.items()})
        parts: dict[tuple[int, int], torch.Tensor] = {}
        for ps, items in by_ps.items():
            for (v, i, _), t in zip(items, replies[ps][1]):
                parts[(v, i)] = t
                self._pulled_bytes += t.numel() * t.element_size()
        for v in dense:
            spec = self.specs[v]
            pieces = [parts[(v, i)] for i in range(len(spec.shards))]
            value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
            p = self.param(v)
            p.data = value.reshape(spec.shape)
            self._seen_version[v] = p._version
        self.stale.difference_update(dense)

    def _fresh_hook(self, module, args) -> None:
        if self.stale:
            self.pull(list(self.stale))

    def pull_rows(self, vid: int, ids: torch.Tensor) -> torch.Tensor:
        spec = self.specs[vid]
        ids = ids.to(torch.int64)
        by_ps: dict[int, list] = defaultdict(list)
        for shard, pos, local in split_rows(spec, ids):
            by_ps[shard.ps].append((shard.key, pos, local))
        replies = self.ps.fan_out({ps: ({"op": "pull_rows", "keys": [k for k, _, _ in items]},
                                      [local for _, _, local in items]) for ps, items in by_ps.items()})
        out = torch.empty((ids.numel(), *spec.shape[1:]), dtype=spec.dtype)
        for ps, items in by_ps.items():
            for (_, pos, _), rows in zip(items, replies[ps][1]):
                out.index_copy_(0, pos, rows)
                self._pulled_bytes += rows.numel() * rows.element_size()
        return out

    def record_rows(self, vid: int, ids: torch.Tensor, leaf: torch.Tensor) -> None:
        self._rows[vid].append((ids, leaf))

    def clear_rows(self, vid: int) -> None:
        self._rows.pop(vid, None)

    def push(self, oid: int, vids: list[int]) -> None:
        if call_abandoned():
            raise CancelledError("the chief abandoned this closure (it found this worker unresponsive and "
                                 "re-queued the closure elsewhere); its gradients are not applied")
        requests: dict[int, tuple[dict, list]] = {}

        def add(ps, key, kind, tensors):
            if ps not in requests:
                requests[ps] = ({"op": "push", "oid": oid, "entries": []}, [])
            requests[ps][0]["entries"].append((key, kind))
            requests[ps][1].extend(tensors)
            self._pushed_bytes += sum(t.numel() * t.element_size() for t in tensors)

        def add_rows(spec, ids, vals):
            for shard, pos, local in split_rows(spec, ids):
                add(shard.ps, shard.key, "rows", [local, vals.index_select(0, pos)])

        stepped_dense = []
        for v in vids:
            spec = self.specs[v]
            if spec.row_path:
                recs = [(ids, leaf.grad) for ids, leaf in self._rows.get(v, []) if leaf.grad is not None]
                if not recs:
                    continue
                ids = torch.cat([r[0] for r in recs])
                vals = torch.cat([r[1] for r in recs])
                if len(recs) > 1:
                    merged = torch.sparse_coo_tensor(ids.unsqueeze(0), vals, spec.shape).coalesce()
                    ids, vals = merged.indices()[0], merged.values()
                add_rows(spec, ids, vals)
                continue
            p = self.param(v)
            g = p.grad
            if g is None:
                continue
            stepped_dense.append(v)
            if g.is_sparse:
                g = g.coalesce()
                add_rows(spec, g.indices()[0], g.values())
            elif not spec.sharded:
                add(spec.shards[0].ps, spec.shards[0].key, "dense", [g])
            else:
                for sh in spec.shards:
                    add(sh.ps, sh.key, "dense", [g[sh.start:sh.stop]])
        if requests:
            self.ps.fan_out(requests)
        self.stale.update(stepped_dense)

    def _write_back_assignments(self) -> None:
        changed = [v for v in self.active if not self.specs[v].row_path and v in self._seen_version
                   and self.params[v]._version != self._seen_version[v]]
        if not changed:
            return
        if call_abandoned():
            raise CancelledError("the chief abandoned this closure; its assignments are not written")
        by_ps: dict[int, tuple[dict, list]] = {}
        for v in changed:
            spec, p = self.specs[v], self.params[v]
            for sh in spec.shards:
                h, ts = by_ps.setdefault(sh.ps, ({"op": "assign", "keys": []}, []))
                h["keys"].append(sh.key)
                ts.append(p.detach()[sh.start:sh.stop] if spec.sharded else p.detach())
            self._seen_version[v] = p._version
        self.ps.fan_out(by_ps)


def _dumps_exception(exc: BaseException) -> bytes:
    blob = cloudpickle.dumps(exc)
    pickle.loads(blob)  # make sure it round-trips here, not on the other side
    return blob
