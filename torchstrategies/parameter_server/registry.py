"""The chief's book of distributed objects: which parameters live where, module structures, optimizers.

Parameters are placed on the ps tasks round-robin (each shard of a partitioned parameter counts as one
placement). The chief keeps its own copy of every parameter; a closure refers to modules, optimizers and
parameters by id (pickle persistent ids), so their data never travels inside a closure. The chief's copy is
refreshed from the ps before the chief runs a module's forward (or asks for its ``state_dict``) after
closures have run, and an in-place change the chief makes to its copy is written to the ps before the next
closure is scheduled.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from torchstrategies.parameter_server.closure_cache import FunctionCache
from torchstrategies.parameter_server.per_worker_input import PerWorkerDataset, PerWorkerDatasetIterator
from torchstrategies.parameter_server.remote_value import PerWorkerValues, RemoteValue
from torchstrategies.parameter_server.specs import ShardSpec, VarSpec
from torchstrategies.parameter_server.variables import PSVariable
from torchstrategies.partitioners import num_shards_from, shard_offsets

__all__ = ["Registry"]

log = logging.getLogger("torchstrategies.parameter_server")


class _ChiefSyncHook:
    """A forward pre-hook (and state_dict pre-hook) that refreshes the chief's copy from the ps."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def __call__(self, *args, **kwargs):
        self.registry.sync_to_chief()


class _FunctionBytes:
    """Stands for a scheduled function already pickled (from the FunctionCache) in a closure's pickle."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        self.blob = blob


class _FunctionInArguments(Exception):
    """The arguments hold a function pickled by value: pickle the closure in one piece, as without the cache
    (functions pickled together share their globals on the worker)."""


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file, registry: Registry, root: torch.nn.Module | None = None,
                 pwv: list[PerWorkerValues] | None = None, arguments_only: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.registry = registry
        self.root = root            # structure mode: the module being described, pickled by value
        self.refs: set[tuple] = set()
        self.pwv: list[PerWorkerValues] = pwv if pwv is not None else []
        self.arguments_only = arguments_only   # the function is a _FunctionBytes; no other function allowed

    def persistent_id(self, obj):
        if self.arguments_only:
            t = type(obj)
            if t is _FunctionBytes:
                return ("fn", obj.blob)
            if t is types.FunctionType and not FunctionCache.by_reference(obj):
                raise _FunctionInArguments
        reg = self.registry
        if isinstance(obj, torch.Tensor):
            vid = reg.param_vid.get(id(obj))
            if vid is not None and reg.params[vid] is obj:
                self.refs.add(("param", vid))
                return ("param", vid)
            return None
        if isinstance(obj, torch.nn.Module):
            if self.root is not None:
                return None
            mid = reg.module_ref(obj)
            if mid is None:
                return None
            self.refs.add(("module", mid))
            return ("module", mid)
        if isinstance(obj, torch.optim.Optimizer):
            oid = reg.optimizer_ref(obj)
            if oid is None:
                return None
            self.refs.add(("optimizer", oid))
            return ("optimizer", oid)
        if isinstance(obj, _ChiefSyncHook):
            return ("nohook",)
        if isinstance(obj, PSVariable):
            vid = reg.variable_vid.get(id(obj))
            if vid is None:
                raise ValueError(f"{obj!r} belongs to another ParameterServerStrategy")
            self.refs.add(("variable", vid))
            return ("variable", vid)
        if isinstance(obj, PerWorkerDatasetIterator):
            if obj._book is not reg:
                raise ValueError("a per-worker iterator of another ClusterCoordinator was passed to schedule()")
            self.refs.add(("iter", obj._iid))
            return ("iter", obj._iid)
        if isinstance(obj, PerWorkerDataset):
            raise ValueError("pass iter(per_worker_dataset) to the scheduled function, not the dataset itself")
        if isinstance(obj, PerWorkerValues):
            self.pwv.append(obj)
            return ("pwv", len(self.pwv) - 1)
        if isinstance(obj, RemoteValue):
            raise ValueError("a RemoteValue used as an input to a scheduled function is not supported "
                             "(TF's rule): fetch() it first")
        if obj is reg.strategy:
            return ("strategy",)
        return None


class Registry:
    """Chief-side placement and bookkeeping (thread-safe)."""

    def __init__(self, strategy, num_ps: int, ps_call, partitioner=None):
        self.strategy = strategy
        self.num_ps = num_ps
        self._ps_call = ps_call                # (ps index, header, tensors) -> (reply, tensors)
        self.partitioner = partitioner
        self.lock = threading.RLock()
        self.specs: dict[int, VarSpec] = {}
        self.params: dict[int, torch.Tensor] = {}      # the chief's own copy of each placed parameter
        self.param_vid: dict[int, int] = {}
        self.recorded_version: dict[int, int] = {}
        self.scope_params: dict[int, torch.Tensor] = {}     # id -> param created under scope()
        self.scope_flags: dict[int, tuple[bool, bool, str]] = {}
        self.modules: dict[int, torch.nn.Module] = {}
        self.module_mid: dict[int, int] = {}
        self.module_blobs: dict[int, bytes] = {}
        self.module_vars: dict[int, list[int]] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.opt_oid: dict[int, int] = {}
        self.opt_defs: dict[int, list[tuple[dict, list[int]]]] = {}
        self.opt_hyper_blob: dict[int, bytes] = {}
        self.variables: dict[int, PSVariable] = {}
        self.variable_vid: dict[int, int] = {}
        self.dataset_blobs: dict[int, bytes] = {}
        self.iter_defs: dict[int, int] = {}
        self._next_id = 0
        self._next_ps = 0
        self.dirty = False                     # closures ran since the chief last refreshed its copies
        self._syncing = False
        self.function_cache = FunctionCache(self.is_reference)

    def new_id(self) -> int:
        with self.lock:
            self._next_id += 1
            return self._next_id

    def new_dataset(self, blob: bytes) -> int:
        """Numbers a per-worker dataset (``blob``: its pickled ``dataset_fn``, sent to each worker once)."""
        did = self.new_id()
        self.dataset_blobs[did] = blob
        return did

    def new_iterator(self, dataset_id: int) -> int:
        """Numbers a per-worker iterator over dataset ``dataset_id`` (``iter(per_worker_dataset)``)."""
        iid = self.new_id()
        self.iter_defs[iid] = dataset_id
        return iid

    # ---- parameters ----------------------------------------------------------------------------
    def track_scope_param(self, module, name: str, param) -> None:
        """Called for every parameter registered on a module while the strategy's scope is active."""
        if param is None:
            return
        self.scope_params[id(param)] = param
        embedding = isinstance(module, torch.nn.Embedding) and name == "weight"
        self.scope_flags[id(param)] = (embedding, bool(getattr(module, "sparse", False)) and embedding,
                                       f"{type(module).__name__}.{name}")

    def place_pending(self) -> None:
        """Places every parameter created under scope() that is not placed yet (called on scope exit)."""
        for pid, p in list(self.scope_params.items()):
            if pid not in self.param_vid:
                self.ensure_param(p)

    def ensure_param(self, p: torch.Tensor, embedding: bool | None = None, sparse: bool | None = None,
                     name: str | None = None) -> int:
        with self.lock:
            vid = self.param_vid.get(id(p))
            if vid is not None:
                return vid
            flags = self.scope_flags.get(id(p), (False, False, "parameter"))
            embedding = flags[0] if embedding is None else embedding
            sparse = flags[1] if sparse is None else sparse
            name = name or flags[2]
            if p.device.type == "meta":
                raise ValueError(f"parameter {name} is on the meta device; materialize it before placing it")
            vid = self.new_id()
            shape = tuple(p.shape)
            k = 1
            if self.partitioner is not None and p.dim() >= 1:
                k = num_shards_from(self.partitioner, torch.Size(shape), p.dtype)
            offsets = shard_offsets(shape[0], k) if p.dim() >= 1 else [0, 0]
            shards = []
            for i in range(k):
                shards.append(ShardSpec(self._next_ps % self.num_ps, f"{vid}/{i}", offsets[i], offsets[i + 1]))
                self._next_ps += 1
            spec = VarSpec(vid, name, shape, p.dtype, bool(p.requires_grad), shards, embedding, sparse)
            self._write(spec, p.detach(), op="create")
            self.specs[vid] = spec
            self.params[vid] = p
            self.param_vid[id(p)] = vid
            self.recorded_version[vid] = p._version
            log.debug("placed %s %s as %d shard(s) on ps %s", name, shape, k, [s.ps for s in shards])
            return vid

    def _write(self, spec: VarSpec, value: torch.Tensor, op: str) -> None:
        by_ps: dict[int, tuple[dict, list]] = {}
        for sh in spec.shards:
            h, ts = by_ps.setdefault(sh.ps, ({"op": op, "keys": [], "sparse": [], "requires_grad": []}, []))
            h["keys"].append(sh.key)
            h["sparse"].append(spec.sparse)
            h["requires_grad"].append(spec.requires_grad)
            ts.append(value[sh.start:sh.stop].contiguous() if spec.sharded else value.contiguous())
        for ps, (h, ts) in by_ps.items():
            self._ps_call(ps, h, ts)

    def create_variable(self, initial_value: object, synchronization: object = None, aggregation: object = None,
                        trainable: bool = False, name: str | None = None) -> PSVariable:
        """A variable on the next ps (round-robin), never partitioned."""
        with self.lock:
            value = initial_value() if callable(initial_value) else initial_value
            value = torch.as_tensor(value).detach().clone()
            if not (value.is_floating_point() or value.is_complex()) and aggregation is not None and \
                    str(getattr(aggregation, "name", aggregation)).upper() == "MEAN":
                raise ValueError(f"a variable of dtype {value.dtype} cannot have MEAN aggregation")
            vid = self.new_id()
            spec = VarSpec(vid, name or f"Variable_{vid}", tuple(value.shape), value.dtype, False,
                           [ShardSpec(self._next_ps % self.num_ps, f"{vid}/0", 0,
                                      value.shape[0] if value.dim() else 0)])
            self._next_ps += 1
            self._write(spec, value, op="create")
            self.specs[vid] = spec
            var = PSVariable(self._ps_call, spec, aggregation, synchronization, trainable)
            self.variables[vid] = var
            self.variable_vid[id(var)] = vid
            return var

    def push_chief_assignments(self) -> None:
        """Writes to the ps every parameter the chief changed in place since it was last synchronized."""
        with self.lock:
            for vid, p in self.params.items():
                if p._version != self.recorded_version[vid]:
                    self._write(self.specs[vid], p.detach(), op="assign")
                    self.recorded_version[vid] = p._version

    def sync_to_chief(self, force: bool = False) -> None:
        """Copies the current ps values into the chief's parameters (when closures ran since the last copy)."""
        with self.lock:
            if self._syncing or not (self.dirty or force) or not self.params:
                return
            self._syncing = True
            try:
                self.push_chief_assignments()
                self.dirty = False
                by_ps: dict[int, list[tuple[int, ShardSpec]]] = {}
                for vid in self.params:
                    for sh in self.specs[vid].shards:
                        by_ps.setdefault(sh.ps, []).append((vid, sh))
                for ps, items in by_ps.items():
                    _, ts = self._ps_call(ps, {"op": "pull", "keys": [sh.key for _, sh in items]}, [])
                    with torch.no_grad():
                        for (vid, sh), t in zip(items, ts):
                            p = self.params[vid]
                            if self.specs[vid].sharded:
                                p[sh.start:sh.stop].copy_(t)
                            else:
                                p.copy_(t.reshape(p.shape))
                for vid, p in self.params.items():
                    self.recorded_version[vid] = p._version
            finally:
                self._syncing = False

    # ---- modules and optimizers ----------------------------------------------------------------
    def _is_distributed(self, params) -> bool:
        return any(id(p) in self.scope_params or id(p) in self.param_vid for p in params)

    def module_ref(self, m: torch.nn.Module) -> int | None:
        with self.lock:
            mid = self.module_mid.get(id(m))
            if mid is not None:
                return mid
            if not self._is_distributed(m.parameters()):
                return None
            vids: list[int] = []
            for sub in m.modules():
                for pname, p in sub.named_parameters(recurse=False):
                    emb = isinstance(sub, torch.nn.Embedding) and pname == "weight"
                    vid = self.ensure_param(p, emb, emb and bool(sub.sparse), f"{type(sub).__name__}.{pname}")
                    if vid not in vids:
                        vids.append(vid)
            mid = self.new_id()
            buf = io.BytesIO()
            _Pickler(buf, self, root=m).dump(m)
            self.module_blobs[mid] = buf.getvalue()
            self.module_vars[mid] = vids
            self.modules[mid] = m
            self.module_mid[id(m)] = mid
            hook = _ChiefSyncHook(self)
            for sub in m.modules():
                if any(True for _ in sub.parameters(recurse=False)) and not any(
                        isinstance(h, _ChiefSyncHook) for h in sub._forward_pre_hooks.values()):
                    sub.register_forward_pre_hook(hook)
                    sub.register_state_dict_pre_hook(hook)
            return mid

    def optimizer_ref(self, opt: torch.optim.Optimizer) -> int | None:
        with self.lock:
            oid = self.opt_oid.get(id(opt))
            if oid is not None:
                return oid
            if not self._is_distributed(p for g in opt.param_groups for p in g["params"]):
                return None
            groups = []
            for g in opt.param_groups:
                hyper = {k: v for k, v in g.items() if k != "params"}
                groups.append((hyper, [self.ensure_param(p) for p in g["params"]]))
            oid = self.new_id()
            cls_blob = cloudpickle.dumps(type(opt))
            for ps in range(self.num_ps):
                ps_groups = [(hyper, self._keys_on(ps, vids)) for hyper, vids in groups]
                if any(keys for _, keys in ps_groups):
                    self._ps_call(ps, {"op": "create_optimizer", "oid": oid, "cls": cls_blob,
                                       "groups": pickle.dumps(ps_groups)}, [])
            self.opt_defs[oid] = groups
            self.optimizers[oid] = opt
            self.opt_oid[id(opt)] = oid
            self.opt_hyper_blob[oid] = self._hyper_blob(opt)
            return oid

    def _keys_on(self, ps: int, vids: list[int]) -> list[str]:
        return [sh.key for v in vids for sh in self.specs[v].shards if sh.ps == ps]

    @staticmethod
    def _hyper_blob(opt) -> bytes:
        return pickle.dumps([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])

    def push_hyperparameters(self) -> None:
        """Sends changed optimizer hyperparameters (e.g. a learning-rate schedule run on the chief)."""
        with self.lock:
            for oid, opt in self.optimizers.items():
                blob = self._hyper_blob(opt)
                if blob == self.opt_hyper_blob[oid]:
                    continue
                groups = [({k: v for k, v in g.items() if k != "params"}, vids)
                          for g, (_, vids) in zip(opt.param_groups, self.opt_defs[oid])]
                for ps in range(self.num_ps):
                    ps_groups = [(hyper, self._keys_on(ps, vids)) for hyper, vids in groups]
                    if any(keys for _, keys in ps_groups):
                        self._ps_call(ps, {"op": "set_hparams", "oid": oid, "groups": pickle.dumps(ps_groups)}, [])
                self.opt_defs[oid] = groups
                self.opt_hyper_blob[oid] = blob

    # ---- closures ------------------------------------------------------------------------------
    def is_reference(self, v: object) -> bool:
        """Whether the closure pickler (``_Pickler.persistent_id``) replaces ``v`` by a reference to this book
        (what the :class:`FunctionCache` may keep inside a cached function)."""
        if isinstance(v, torch.Tensor):
            vid = self.param_vid.get(id(v))
            return vid is not None and self.params[vid] is v
        if isinstance(v, torch.nn.Module):
            mid = self.module_mid.get(id(v))
            return mid is not None and self.modules[mid] is v
        if isinstance(v, torch.optim.Optimizer):
            oid = self.opt_oid.get(id(v))
            return oid is not None and self.optimizers[oid] is v
        if isinstance(v, PSVariable):
            vid = self.variable_vid.get(id(v))
            return vid is not None and self.variables[vid] is v
        if isinstance(v, PerWorkerDatasetIterator):
            return v._book is self
        if isinstance(v, (PerWorkerDataset, RemoteValue)):
            return False                  # the pickler raises its error for these
        if isinstance(v, PerWorkerValues):
            return True                   # its per-worker value is pickled when the closure is sent
        return v is self.strategy

    def dumps(self, obj: object) -> tuple[bytes, set[tuple], list[PerWorkerValues]]:
        buf = io.BytesIO()
        pickler = _Pickler(buf, self)
        pickler.dump(obj)
        return buf.getvalue(), pickler.refs, pickler.pwv

    def dumps_closure(self, fn: Callable[..., object], args: tuple,
                      kwargs: dict) -> tuple[bytes, set[tuple], list[PerWorkerValues]]:
        """``dumps((fn, args, kwargs))``, reusing the pickle of ``fn`` from the :class:`FunctionCache`.

        A cached function travels inside the closure's pickle as a persistent id ``("fn", its pickle)``,
        which the worker unpickles in place (with the same references); the arguments are pickled every time.
        """
        cache = self.function_cache
        if not isinstance(fn, types.FunctionType):   # partials, bound methods, callable objects
            return self.dumps((fn, args, kwargs))
        fingerprint = cache.fingerprint(fn)
        if fingerprint is None:
            return self.dumps((fn, args, kwargs))
        entry = cache.lookup(fn, fingerprint)
        if entry is None:
            num_modules = len(sys.modules)
            buf = io.BytesIO()
            pickler = _Pickler(buf, self)
            pickler.dump(fn)
            entry = cache.store(fn, fingerprint, num_modules, buf.getvalue(), pickler.refs, pickler.pwv)
        buf = io.BytesIO()
        pickler = _Pickler(buf, self, pwv=list(entry.pwv), arguments_only=True)
        try:
            pickler.dump((_FunctionBytes(entry.blob), args, kwargs))
        except _FunctionInArguments:
            return self.dumps((fn, args, kwargs))
        return buf.getvalue(), entry.refs | pickler.refs, pickler.pwv

    def defs_for(self, refs: set[tuple], sent: set[tuple]) -> dict:
        """The definitions a worker needs for ``refs`` that it was not sent yet (``sent`` is updated)."""
        with self.lock:
            defs: dict[str, Any] = {"vars": [], "modules": {}, "module_vars": {}, "optimizers": {},
                                    "datasets": {}, "iters": {}}

            def var(v):
                if ("var", v) not in sent:
                    sent.add(("var", v))
                    defs["vars"].append(self.specs[v])

            for kind, ident in sorted(refs):
                if (kind, ident) in sent and kind != "optimizer":
                    continue
                if kind in ("param", "variable"):
                    var(ident)
                elif kind == "module":
                    for v in self.module_vars[ident]:
                        var(v)
                    defs["modules"][ident] = self.module_blobs[ident]
                    defs["module_vars"][ident] = self.module_vars[ident]
                elif kind == "optimizer":
                    for _, vids in self.opt_defs[ident]:
                        for v in vids:
                            var(v)
                    if (kind, ident) in sent:
                        continue
                    defs["optimizers"][ident] = self.opt_defs[ident]
                elif kind == "iter":
                    did = self.iter_defs[ident]
                    if ("dataset", did) not in sent:
                        sent.add(("dataset", did))
                        defs["datasets"][did] = self.dataset_blobs[did]
                    defs["iters"][ident] = did
                sent.add((kind, ident))
            return defs

