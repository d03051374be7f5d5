"""``MultiWorkerMirroredStrategy``: synchronous data parallelism, one process per device, under torchrun.

TF's ``tf.distribute.MultiWorkerMirroredStrategy`` for PyTorch. Each process (worker) holds one replica;
``num_replicas_in_sync`` is the world size and ``replica_id_in_sync_group`` the rank.

* Launch: ``torchrun --standalone --nproc_per_node=2 train.py`` (or ``--nnodes``/rendezvous on many hosts);
  a ``TF_CONFIG`` cluster works through ``TFConfigClusterResolver``. The strategy initializes the default
  process group itself when the caller has not (gloo on CPU, NCCL on CUDA, timeout from
  ``communication_options.timeout_seconds``) and destroys it in :meth:`shutdown` (also at exit).
* ONE torch ProcessGroup carries all cross-worker traffic: the user's (``process_group=``), else one the
  strategy makes from ``communication_options`` (``distribute/collective_all_reduce.py``): gradients,
  the initial broadcast, ``reduce``/``gather``/``reduce_to``, SyncBatchNorm, checkpoints, barriers and
  input agreement, all with public ``torch.distributed`` calls.
* Under ``scope()``: modules are moved to the local device (``cuda:LOCAL_RANK`` or cpu) and their
  parameters and buffers broadcast from rank 0, so workers start identical whatever their seeds. A tensor
  is synced once; the strategy remembers it by a weak reference, so a tensor made later at a freed one's
  address is synced too. Gradients are summed across workers in buckets during ``loss.backward()`` (see
  ``_grad_sync``); buffers are ON_READ/MEAN (``torchstrategies.checkpoint`` saves their cross-worker mean).
* ``strategy.extended.no_sync()`` accumulates gradients locally; the next synchronized backward (or
  ``optimizer.step()``) reduces the total once.

Decisions the contract left open (see docs/multi_worker.md): ``bytes_per_pack=0`` means one bucket per
dtype/device (TF: "no splitting"); backward returns with reduced gradients (as DDP does), and
``optimizer.step()`` waits as well; gradient compression is the keyword-only extension
``gradient_compression="float16" | "bfloat16"``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategies.cluster_resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
)
from torchstrategies.collectives import CommunicationOptions
from torchstrategies.distribute.collective_all_reduce import CollectiveAllReduce, PendingAllReduce
from torchstrategies.distribute.distribute_lib import Strategy, StrategyExtended
from torchstrategies.distribute.input_lib import InputOptions
from torchstrategies.distribute.replica_share import guard_embedding, guard_register_hook
from torchstrategies.distribute.torch_patches import PatchSet, wrap_attribute
from torchstrategies.distribute.values import (
    Destinations,
    DistributedValues,
    Mirrored,
    Reducible,
    local_results,
)
from torchstrategies.errors import TorchStrategiesError, UnavailableError
from torchstrategies.reduce_op import ReduceOp
from torchstrategies.strategies import _keras
from torchstrategies.strategies._agreement import WorkerAgreement
from torchstrategies.strategies._grad_sync import (
    CompressionHook,
    GradBucket,
    GradientSynchronizer,
    Hook,
    allreduce_hook,
)
from torchstrategies.strategies._health import HealthMonitor
from torchstrategies.strategies._metric_schedulers import multi_worker_plateau_step
from torchstrategies.strategies._mw_input import WorkerShardedDataset, is_map_style_loader, loader_seed
from torchstrategies.strategies._step_sync import Synchronizers, average_mean_buffers

__all__ = ["MultiWorkerMirroredStrategy", "MultiWorkerMirroredExtended", "live_extendeds", "GradBucket",
           "allreduce_hook", "CompressionHook"]

log = logging.getLogger("torchstrategies.multi_worker")
T = TypeVar("T")

_COMPRESSION = {None: None, "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


# The strategies of this process not yet shut down: process-wide, not per group (nothing else sees every
# strategy), held weakly so that it extends no strategy's life; torchstrategies.checkpoint asks it whether a
# save is a collective. Each strategy adds itself when made and removes itself in shutdown().
_LIVE: weakref.WeakSet[MultiWorkerMirroredExtended] = weakref.WeakSet()


def live_extendeds() -> list[MultiWorkerMirroredExtended]:
    """The extended objects of the MultiWorkerMirroredStrategy instances not yet shut down."""
    return [e for e in _LIVE if not e._closed]


def _import_dynamo_first() -> None:
    """Imports torch._dynamo before the strategy makes any process group.

    torch 2.13 keeps a process group that existed when torch._dynamo was first imported alive after
    ``destroy_process_group()`` (references from C++, found by experiment). Creating any torch optimizer
    imports torch._dynamo (about 1.3 s), which users do right after making the strategy. A gloo group kept
    alive that way still has its worker threads at interpreter exit; one that frees its last work item
    during finalization aborts the process ("terminate called without an active exception", exit -6 under
    torchrun). Importing it first costs nothing extra when an optimizer follows, and lets ``shutdown()``
    free the groups and their threads.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch without dynamo has nothing to capture the group either
        pass


def _shutdown_at_exit(ref: weakref.ref[MultiWorkerMirroredExtended]) -> None:
    extended = ref()
    if extended is not None:
        extended.shutdown()


def _default_resolver() -> ClusterResolver:
    if "RANK" in os.environ or "TF_CONFIG" not in os.environ:
        return TorchrunClusterResolver()
    return TFConfigClusterResolver()


class MultiWorkerMirroredExtended(StrategyExtended):
    """The extended API of :class:`MultiWorkerMirroredStrategy` (``strategy.extended``)."""

    def __init__(self, container: Strategy, communication_options: CommunicationOptions | None,
                 cluster_resolver: ClusterResolver | None, gradient_compression: str | torch.dtype | None,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__(container)
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise TypeError(f"communication_options must be a ts.CommunicationOptions, got {communication_options!r}")
        self._options = communication_options if communication_options is not None else CommunicationOptions()
        if gradient_compression not in _COMPRESSION:
            raise ValueError(
                f"gradient_compression must be None, 'float16' or 'bfloat16', got {gradient_compression!r}")
        self._compression = _COMPRESSION[gradient_compression]
        self._owns_process_group = False
        self._store: dist.Store | None = None
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {process_group!r}")
        self._cluster_resolver = self._join_cluster(cluster_resolver, process_group)
        # The one seam: every cross-worker operation of this strategy goes through its process group.
        self._cross_device_ops = CollectiveAllReduce(self._options, group=process_group)
        self._rank, self._world = self._cross_device_ops.rank, self._cross_device_ops.world_size
        self._num_replicas_in_sync = self._world
        self._replica_id_offset = self._rank
        self._worker_devices = (self._device,)
        store = self._store
        if store is None:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - heartbeats are diagnostics only
                pass
        self._health = HealthMonitor(store, self._rank, self._world)
        self._synchronizers = Synchronizers(self._new_synchronizer)
        self._modules: list[weakref.ref[torch.nn.Module]] = []  # made in the scope: their buffers
        self._pending_optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # made in the scope
        self._comm_hook: Hook | None = None if self._compression is None else CompressionHook(self._compression)
        # Tensors already broadcast, by identity that dies with them (an id() would be reused by a new one).
        self._synced: WeakIdKeyDictionary = WeakIdKeyDictionary()
        before_step = weakref.WeakMethod(self._before_step)   # the hooks must not keep the strategy alive
        after_step = weakref.WeakMethod(self._after_step)

        def step_pre_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            method = before_step()
            if method is not None:
                method(optimizer, args, kwargs)

        def step_post_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            method = after_step()
            if method is not None:
                method(optimizer)

        plateau_step = multi_worker_plateau_step(self)  # (these hold the strategy weakly)
        shared = _shared_gradient(weakref.ref(self))
        self._torch_leases.append(PatchSet("MultiWorkerMirroredStrategy", [
            lambda: register_optimizer_step_pre_hook(step_pre_hook).remove,
            lambda: register_optimizer_step_post_hook(step_post_hook).remove,
            lambda: wrap_attribute(ReduceLROnPlateau, "step", plateau_step),
            lambda: wrap_attribute(torch.Tensor, "register_hook", guard_register_hook(shared)),
            *(functools.partial(wrap_attribute, torch.nn.functional, name, guard_embedding(shared))
              for name in ("embedding", "embedding_bag")),
        ]).acquire(self))
        # The agreement seam's per-step check (strategies/_agreement.py): every rank the same schedule (debug
        # mode is checked to agree across ranks by the collectives).
        self.agreement = WorkerAgreement(self.all_reduce_tensors, self.all_reduce_tensors_async, self._rank,
                                         self._world, self._device, self._modules)
        self._closed = False
        _LIVE.add(self)
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        log.info("MultiWorkerMirroredStrategy: rank %d of %d on %s, %r", self._rank, self._world, self._device,
                 self._cross_device_ops)

    # --- set-up -------------------------------------------------------------------------------------------
    def _join_cluster(self, cluster_resolver: ClusterResolver | None,
                      process_group: dist.ProcessGroup | None) -> ClusterResolver:
        """Picks the device and the resolver, and initializes the default process group if nobody has;
        checks that the resolver and an existing process group agree on this rank and the world."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            if cluster_resolver is None:
                if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
                    cluster_resolver = TorchrunClusterResolver()
                else:
                    cluster_resolver = SimpleClusterResolver({"worker": [f"rank:{r}" for r in range(world)]},
                                                             task_type="worker", task_id=rank)
        else:
            if process_group is not None:
                raise ValueError("process_group was given but torch.distributed is not initialized")
            if cluster_resolver is None:
                cluster_resolver = _default_resolver()
            rank, world = cluster_resolver.rank, cluster_resolver.world_size
        self._device = self._pick_device(cluster_resolver)
        _import_dynamo_first()
        if not dist.is_initialized():
            self._init_process_group(cluster_resolver)
            rank, world = dist.get_rank(), dist.get_world_size()
        elif cluster_resolver.world_size != world or cluster_resolver.rank != rank:
            raise ValueError(
                f"the cluster resolver says rank {cluster_resolver.rank} of {cluster_resolver.world_size}, but the "
                f"initialized process group is rank {rank} of {world}")
        if process_group is not None and process_group.size() != world:
            raise ValueError(f"MultiWorkerMirroredStrategy spans every worker: process_group has "
                             f"{process_group.size()} of the {world} ranks")
        return cluster_resolver

    @staticmethod
    def _pick_device(resolver: ClusterResolver) -> torch.device:
        if torch.cuda.is_available():
            local = resolver.local_rank
            if local >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible; launch "
                    f"at most {torch.cuda.device_count()} processes per node (torchrun --nproc_per_node)")
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _init_process_group(self, resolver: ClusterResolver) -> None:
        backend = "nccl" if self._device.type == "cuda" else "gloo"
        try:
            addr, port = resolver.master_addr, resolver.master_port
            rank, world = resolver.rank, resolver.world_size
        except ValueError as exc:
            raise ValueError(f"MultiWorkerMirroredStrategy cannot find the cluster: {exc}") from None
        timeout = None
        if self._options.timeout_seconds is not None:
            timeout = datetime.timedelta(seconds=float(self._options.timeout_seconds))
        # Under torchrun the agent hosts the store and keeps it across restarts (--max-restarts): keys of an
        # earlier attempt (e.g. gloo's peer addresses) would be read back stale, so each attempt gets its
        # own key prefix. Elsewhere rank 0 hosts the store.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store_timeout = timeout if timeout is not None else dist.distributed_c10d.default_pg_timeout
        try:
            store: dist.Store = dist.TCPStore(addr, port, world_size=world, is_master=(not agent and rank == 0),
                                       timeout=store_timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            raise UnavailableError(
                f"MultiWorkerMirroredStrategy: rank {rank} cannot reach the rendezvous store at {addr}:{port} "
                f"({exc}). Check MASTER_ADDR/MASTER_PORT (or TF_CONFIG) and that rank 0 is running.") from exc
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        store = dist.PrefixStore(f"torchstrategies/{run_id}/attempt_{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=self._device if self._device.type == "cuda" else None)
        self._store = store
        self._owns_process_group = True

    def shutdown(self) -> None:
        """Removes the hooks, stops the heartbeat and destroys the process groups this strategy made."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _LIVE.discard(self)
        self._release_torch_patches()
        self._synchronizers.close()
        self._health.stop()
        if dist.is_initialized():
            for g in self._cross_device_ops.owned_groups:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(g)
            if self._owns_process_group:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
        self._store = None

    # --- properties ---------------------------------------------------------------------------------------
    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def transport_name(self) -> str:
        """The CommunicationImplementation the strategy's group was made for."""
        return self._cross_device_ops.implementation_name

    @property
    def cross_device_ops(self) -> CollectiveAllReduce:
        """The ``CollectiveAllReduce`` that carries every cross-worker operation of this strategy."""
        return self._cross_device_ops

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch ProcessGroup all of this strategy's cross-worker traffic goes through."""
        return self._cross_device_ops.group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints (the chief, rank 0), as TF's ``extended.should_checkpoint``."""
        return self._rank == 0

    @property
    def should_save_summary(self) -> bool:
        return self._rank == 0

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        return True

    # --- creation hooks -----------------------------------------------------------------------------------
    def _on_module_created(self, module: torch.nn.Module) -> None:
        if module_device_mismatch(module, self._device):
            module.to(self._device)  # parameters keep their identity; moved buffers are new tensors
        params = [p for p in module.parameters() if p not in self._synced]
        buffers = [b for b in module.buffers() if b not in self._synced]
        self._modules.append(weakref.ref(module))
        self._adopt(params, buffers)

    def _on_keras_module(self, module: torch.nn.Module) -> None:
        """A Keras 3 model made in the scope trains with ``fit`` as one model over the workers
        (``_keras.py``); its weights are adopted by ``_on_module_created`` like any module's."""
        if _keras.is_keras_model(module):
            _keras.attach(self, module, in_process=False)

    def _on_optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer made in the scope over parameters made outside it (a model built before the
        strategy): they are broadcast from rank 0 and their gradients synchronized, as a model made in the
        scope (Mirrored replicates them the same way); that model's buffers stay per rank."""
        self._pending_optimizers.append(weakref.ref(optimizer))

    def _flush_created(self) -> None:
        super()._flush_created()  # the modules first: an optimizer made in the scope adopts only the rest
        pending, self._pending_optimizers = self._pending_optimizers, []
        for optimizer in (r() for r in pending):
            if optimizer is not None:
                params = [p for g in optimizer.param_groups for p in g["params"] if p not in self._synced]
                if params:
                    self._adopt(list(dict.fromkeys(params)), [])

    def _adopt(self, params: list[torch.nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Broadcasts ``params`` and ``buffers`` from rank 0 and synchronizes the gradients of ``params``
        (the trainable ones now, the others once made trainable)."""
        self.broadcast_tensors([p.data for p in params] + buffers, src=0)
        if params:
            self._synchronizers.add(self._new_synchronizer(params, True))
        for t in itertools.chain(params, buffers):
            self._synced[t] = True

    def _new_synchronizer(self, params: list[torch.nn.Parameter], autograd_hooks: bool) -> GradientSynchronizer:
        return GradientSynchronizer(params, self.process_group, self._options.bytes_per_pack, self._comm_hook,
                                    self._health, autograd_hooks=autograd_hooks, name_of=self._parameter_name)

    def _parameter_name(self, param: torch.Tensor) -> str:
        return next((n for n, p in self.named_parameters() if p is param), f"of shape {tuple(param.shape)}")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        """The optimizer step pre-hook: every gradient the step applies is the cross-worker sum
        (``_step_sync.py``), the MEAN buffers of the modules it trains are averaged (the one point per step where
        buffers are synchronized, docs/strategies.md), and the agreement check runs (``_agreement.py``). An
        optimizer none of whose parameters the strategy watches is plain torch beside the strategy (a per-rank
        model, stepped on some ranks only: left alone), unless the strategy watches nothing at all: then the
        model and optimizer were made outside the scope, every rank trains a model of its own, and its
        parameters are compared across the ranks (issue 46, case 5). The check's all-reduce travels during the
        update; the post-hook finishes it."""
        watched = self._synchronizers.before_step(optimizer)
        held = self.agreement.held(optimizer) if watched else None   # one walk of the modules a step
        if held is not None:
            average_mean_buffers(held.mean, self.all_reduce_tensors)
        if watched or not self._synchronizers.live():
            self.agreement.before_step(optimizer, held)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.agreement.after_step(optimizer)   # raises ReplicaDivergenceError on every rank, after the update

    def synchronizes_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a parameter (or buffer) this strategy adopted (broadcast, synchronized)."""
        return param in self._synced

    def owns_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps parameters this strategy synchronizes."""
        return bool(self._synchronizers.for_optimizer(optimizer)[0])

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters of the modules made in the scope, each once, named by module class and path."""
        named: list[tuple[str, torch.Tensor]] = []
        seen: set[int] = set()
        for m in (r() for r in self._modules):
            if m is None:
                continue
            for name, t in m.named_parameters():
                if id(t) not in seen:
                    seen.add(id(t))
                    named.append((f"{type(m).__name__}.{name}", t))
        return named

    def check_divergence(self, when: str = "a checkpoint save") -> None:
        """Raises ``ReplicaDivergenceError`` unless every rank holds the same parameters of the modules made
        in the scope, every one whole (the agreement seam: one small all-reduce; buffers are ON_READ, checked
        at each step and by a checkpoint save). Every worker calls it."""
        self.agreement.check_all(when)

    def sync_buffers(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The buffers of the modules made in the scope that are declared MEAN (``distribute/buffers.py``:
        norm layers' running statistics, ``ts.declare_buffer_aggregation``) become their cross-worker mean
        (every other buffer is compared by the agreement check). Every worker calls it (at each
        ``optimizer.step()``).

        At a step of ``optimizer``: the buffers of the modules that share a parameter with it, and of those with
        no trainable parameter (a teacher, a parameterless normalization); not of a module trained by another
        optimizer (``_agreement.steps_with``). So the set is the same on every rank whatever the garbage
        collector has freed: a model of an earlier fold or sweep trial, kept alive by a reference cycle on one
        rank only, is not in it."""
        average_mean_buffers(self.agreement.mean_buffers(optimizer), self.all_reduce_tensors)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block.

        Example:
            >>> with strategy.extended.no_sync():        # doctest: +SKIP
            ...     loss_fn(model, batch_1).backward()
            >>> loss_fn(model, batch_2).backward()      # reduces the sum of both  # doctest: +SKIP
        """
        with self._synchronizers.no_sync():
            yield

    def register_comm_hook(self, hook: Hook) -> None:
        """Sends gradient buckets through ``hook(state, bucket) -> torch.futures.Future`` (DDP's comm hooks).

        ``state`` is the strategy's process group (``extended.process_group``); ``bucket.buffer()`` is the
        flat bucket, and the future's value must be its reduced contents, a tensor of the same shape (SUM
        over workers; torch's own ``default_hooks.allreduce_hook`` averages instead). Applies to the modules
        made so far and later.

        Example:
            >>> from torchstrategies.strategies.multi_worker_mirrored import allreduce_hook   # doctest: +SKIP
            >>> strategy.extended.register_comm_hook(allreduce_hook)                         # doctest: +SKIP
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket), got {hook!r}")
        self._comm_hook = hook
        self._synchronizers.set_hook(hook)

    @property
    def gradient_synchronizers(self) -> tuple[GradientSynchronizer, ...]:
        return tuple(self._synchronizers.live())

    # --- communication: every call goes through the strategy's process group ------------------------------
    def _guard(self, fn: Callable[[], T], what: str, started: bool = True) -> T:
        self._health.seq += started   # (a wait for a collective started earlier is not a new one)
        try:
            return fn()
        except (RuntimeError, TimeoutError) as exc:
            if isinstance(exc, TorchStrategiesError):
                raise
            raise self._health.diagnose(exc, what) from exc

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrites ``tensors`` in place with rank ``src``'s values (packed per dtype). Every worker calls it."""
        self._guard(lambda: self._cross_device_ops.broadcast_(tensors, src), "broadcast")

    def all_reduce_tensors(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor],
                           options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """Each tensor reduced over every worker (new tensors), in any context. Every worker calls it."""
        rop = ReduceOp.from_any(op)
        return self._guard(lambda: self._cross_device_ops.all_reduce_tensors(rop, tensors, options),
                           f"{rop.name} all-reduce")

    def all_reduce_tensors_async(self, op: ReduceOp | str, tensors: Sequence[torch.Tensor]) -> PendingAllReduce:
        """:meth:`all_reduce_tensors` started now; the handle's ``wait()`` returns the reduced tensors. Every
        worker starts it, and waits for it, in the same order."""
        rop = ReduceOp.from_any(op)
        what = f"{rop.name} all-reduce"
        pending = self._guard(lambda: self._cross_device_ops.all_reduce_tensors_async(rop, tensors), what)
        return PendingAllReduce(lambda: self._guard(pending.wait, what, started=False))

    def all_gather_parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``t`` (rank >= 1, its length along dim 0 may differ), in rank order, on every worker
        (the sizes, then the rows padded to the longest: two all-gathers). Every worker calls it."""
        return self._guard(lambda: self._cross_device_ops.gather_parts(t), "all-gather")

    def barrier(self) -> None:
        """Returns when every worker has called it; a dead or hung worker raises a named error."""
        self._guard(self._cross_device_ops.barrier, "barrier")

    def _reduce_to(self, op: ReduceOp, value: Reducible, destinations: Destinations | None,
                   options: CommunicationOptions | None) -> torch.Tensor | Mirrored[torch.Tensor]:
        return self._batch_reduce_to(op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, op: ReduceOp, pairs: Sequence[tuple[Reducible, Destinations | None]],
                         options: CommunicationOptions | None) -> list[torch.Tensor | Mirrored[torch.Tensor]]:
        tensors = []
        for v, _ in pairs:
            comps = local_results(v) if isinstance(v, DistributedValues) else (v,)
            if len(comps) != 1:
                raise ValueError(f"MultiWorkerMirroredStrategy has one replica per worker, got {len(comps)} "
                                 f"components in {v!r}")
            tensors.append(torch.as_tensor(comps[0]))
        reduced = self.all_reduce_tensors(op, tensors, options)
        return [self._to_destinations(r, self._destination_devices(d)) for r, (_, d) in zip(reduced, pairs)]

    def _gather_to(self, value: Reducible, destinations: Destinations | None, axis: int,
                   options: CommunicationOptions | None) -> torch.Tensor | Mirrored[torch.Tensor]:
        comps = local_results(value) if isinstance(value, DistributedValues) else (value,)
        t = torch.as_tensor(comps[0])
        if t.dim() == 0:
            raise ValueError(f"gather needs a tensor of rank >= 1 to concatenate along axis {axis}, got a scalar")
        out = self._guard(lambda: self._cross_device_ops.gather(t, axis, options), "all-gather")
        return self._to_destinations(out, self._destination_devices(destinations))

    # --- input --------------------------------------------------------------------------------------------
    def _input_workers(self) -> tuple[int, int]:
        return self._world, self._rank

    def _input_max_over_pipelines(self, values: list[int]) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64, device=self._device)
        (out,) = self.all_reduce_tensors(ReduceOp.MAX, [flags])
        return [int(v) for v in out.tolist()]

    def _shared_seed(self) -> int:
        seed = torch.tensor([int(torch.randint(0, 2**31 - 1, (1,)).item())], dtype=torch.int64)
        self.broadcast_tensors([seed], src=0)
        return int(seed.item())

    def _experimental_distribute_dataset(
        self, dataset: Iterable[object], options: InputOptions | None
    ) -> Iterable[Any]:
        if is_map_style_loader(dataset):
            named = loader_seed(cast(DataLoader, dataset))
            seed = named if named is not None else self._shared_seed()
            fetch = getattr(options, "experimental_fetch_to_device", True) if options is not None else True
            return WorkerShardedDataset(cast(DataLoader, dataset), self._world, self._rank, seed,
                                        self._device if fetch else None)
        return super()._experimental_distribute_dataset(dataset, options)


def _shared_gradient(ref: weakref.ref[MultiWorkerMirroredExtended]) -> Callable[[torch.Tensor], bool]:
    """Whether a parameter's gradient is this worker's share (``distribute/replica_share.py``)."""

    def shared(param: torch.Tensor) -> bool:
        ext = ref()
        return ext is not None and ext.world_size > 1 and ext.synchronizes_parameter(param)

    return shared


def module_device_mismatch(module: torch.nn.Module, device: torch.device) -> bool:
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device != device:
            return True
    return False


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training across processes (``tf.distribute.MultiWorkerMirroredStrategy``), one replica each.

    Args:
        communication_options: ``ts.CommunicationOptions`` (``bytes_per_pack``: gradient bucket size, 0 = one
            bucket; ``timeout_seconds``: collective and process-group timeout; ``implementation``: which
            process group (backend) carries every cross-worker operation).
        cluster_resolver: where the cluster is described; default ``TorchrunClusterResolver()`` (or
            ``TFConfigClusterResolver()`` when only ``TF_CONFIG`` is set). Ignored for rank/world when a
            process group is already initialized (it must agree).
        gradient_compression: keyword-only extension: ``"float16"`` / ``"bfloat16"`` sends gradients in 16
            bits and sums them in float32 (error bound in ``strategies/_grad_sync.py``).
        process_group: keyword-only extension: a ``torch.distributed`` ProcessGroup over every rank to send
            everything through (e.g. one on the ``"torchstrategies"`` backend you made); None: the strategy
            makes one from ``communication_options``.

    Raises:
        ValueError: the environment does not describe a cluster (names the missing variable and how to
            launch), or a bad option (e.g. both ``process_group`` and an ``implementation``).

    Example:
        >>> # torchrun --standalone --nproc_per_node=2 train.py
        >>> import torch, torchstrategies as ts                       # doctest: +SKIP
        >>> strategy = ts.MultiWorkerMirroredStrategy()               # doctest: +SKIP
        >>> with strategy.scope():                                    # doctest: +SKIP
        ...     model = torch.nn.Linear(4, 1)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def step(x, y):                                           # doctest: +SKIP
        ...     loss = ts.compute_average_loss((model(x) - y).pow(2).squeeze(1), global_batch_size=64)
        ...     loss.backward(); opt.step(); opt.zero_grad()
        ...     return loss
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 cluster_resolver: ClusterResolver | None = None, *,
                 gradient_compression: str | torch.dtype | None = None, process_group: dist.ProcessGroup | None = None):
        super().__init__(MultiWorkerMirroredExtended(self, communication_options, cluster_resolver,
                                                     gradient_compression, process_group))

    @property
    def extended(self) -> MultiWorkerMirroredExtended:
        return cast(MultiWorkerMirroredExtended, self._extended)

    def shutdown(self) -> None:
        """Releases hooks and the process groups this strategy created (also done at interpreter exit)."""
        self.extended.shutdown()

    def __enter__(self) -> MultiWorkerMirroredStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        ext = self.extended
        return (f"<MultiWorkerMirroredStrategy rank={ext.rank} replicas={self.num_replicas_in_sync} "
                f"transport={ext.transport_name}>")
