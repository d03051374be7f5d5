"""``MultiWorkerMirroredStrategy``: synchronous data parallelism, one process per device, under torchrun.

TF's ``tf.distribute.MultiWorkerMirroredStrategy`` for PyTorch. Each process (worker) holds one replica;
``num_replicas_in_sync`` is the world size and ``replica_id_in_sync_group`` the rank.

* Launch: ``torchrun --standalone --nproc_per_node=2 train.py`` (or ``--nnodes``/rendezvous on many hosts);
  a ``TF_CONFIG`` cluster works through ``TFConfigClusterResolver``. The strategy initializes the default
  process group itself when the caller has not (gloo on CPU, NCCL on CUDA, timeout from
  ``communication_options.timeout_seconds``: ``_mw_cluster.py``) and destroys it in :meth:`shutdown` (also
  at exit).
* ONE torch ProcessGroup carries all cross-worker traffic: the user's (``process_group=``), else one the
  strategy makes from ``communication_options`` (``distribute/collective_all_reduce.py``): gradients,
  the initial broadcast, ``reduce``/``gather``/``reduce_to``, SyncBatchNorm, checkpoints, barriers and
  input agreement, all with public ``torch.distributed`` calls (the extended's calls: ``_mw_collectives.py``).
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
import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from torch.utils.weak import WeakIdKeyDictionary

from torchstrategies.cluster_resolver import ClusterResolver
from torchstrategies.collectives import CommunicationOptions
from torchstrategies.distribute.collective_all_reduce import CollectiveAllReduce
from torchstrategies.distribute.distribute_lib import Strategy
from torchstrategies.distribute.input_lib import InputOptions
from torchstrategies.distribute.replica_share import (
    StepArgs,
    guard_embedding,
    guard_register_hook,
    with_global_loss,
)
from torchstrategies.distribute.torch_patches import PatchSet, wrap_attribute
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
from torchstrategies.strategies._mw_cluster import join_cluster
from torchstrategies.strategies._mw_collectives import WorkerCollectives
from torchstrategies.strategies._mw_input import WorkerShardedDataset, is_map_style_loader, loader_seed
from torchstrategies.strategies._step_sync import Synchronizers, average_mean_buffers

__all__ = ["MultiWorkerMirroredStrategy", "MultiWorkerMirroredExtended", "live_extendeds", "GradBucket",
           "allreduce_hook", "CompressionHook"]

log = logging.getLogger("torchstrategies.multi_worker")

_COMPRESSION = {None: None, "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


# The strategies of this process not yet shut down: process-wide, not per group (nothing else sees every
# strategy), held weakly so that it extends no strategy's life; torchstrategies.checkpoint asks it whether a
# save is a collective. Each strategy adds itself when made and removes itself in shutdown().
_LIVE: weakref.WeakSet[MultiWorkerMirroredExtended] = weakref.WeakSet()


def live_extendeds() -> list[MultiWorkerMirroredExtended]:
    """The extended objects of the MultiWorkerMirroredStrategy instances not yet shut down."""
    return [e for e in _LIVE if not e._closed]


def _shutdown_at_exit(ref: weakref.ref[MultiWorkerMirroredExtended]) -> None:
    extended = ref()
    if extended is not None:
        extended.shutdown()


class MultiWorkerMirroredExtended(WorkerCollectives):
    """The extended API of :class:`MultiWorkerMirroredStrategy` (``strategy.extended``); its cross-worker calls
    are its base's, :class:`WorkerCollectives` (``_mw_collectives.py``)."""

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
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {process_group!r}")
        joined = join_cluster(cluster_resolver, process_group, self._options)  # (strategies/_mw_cluster.py)
        # Every cross-worker call runs eagerly inside a compiled function (dynamo cannot trace a ProcessGroup).
        # Wrapped here, where join_cluster has imported torch._dynamo, not at import: importing torchstrategies
        # must not import torch._dynamo after a user's process group exists (it would keep that group alive
        # past destroy_process_group, docs/collectives.md).
        self._guard = torch.compiler.disable(self._guard)  # type: ignore[method-assign]
        self._cluster_resolver, self._device = joined.resolver, joined.device
        self._store: dist.Store | None = joined.store
        self._owns_process_group = joined.owns_process_group
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

        def step_pre_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> StepArgs | None:
            method = before_step()
            return None if method is None else method(optimizer, args, kwargs)

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
            lambda: wrap_attribute(torch.Tensor, "register_post_accumulate_grad_hook",
                                   guard_register_hook(shared, post_accumulate=True)),
            *(functools.partial(wrap_attribute, torch.nn.functional, name, guard_embedding(shared))
              for name in ("embedding", "embedding_bag")),
        ]).acquire(self))
        # The agreement seam's per-step check (strategies/_agreement.py): every rank the same schedule (debug
        # mode is checked to agree across ranks by the collectives).
        self.agreement = WorkerAgreement(self.all_reduce_in_place, self._rank, self._world, self._device,
                                         self._modules)
        self._closed = False
        _LIVE.add(self)
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        log.info("MultiWorkerMirroredStrategy: rank %d of %d on %s, %r", self._rank, self._world, self._device,
                 self._cross_device_ops)

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

    def _before_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> StepArgs | None:
        """The optimizer step pre-hook: every gradient the step applies is the cross-worker sum
        (``_step_sync.py``), the MEAN buffers of the modules it trains are averaged (the one point per step where
        buffers are synchronized, docs/strategies.md), and the agreement check runs (``_agreement.py``). An
        optimizer none of whose parameters the strategy watches is plain torch beside the strategy (a per-rank
        model, stepped on some ranks only: left alone), unless the strategy watches nothing at all: then the
        model and optimizer were made outside the scope, every rank trains a model of its own, and its
        parameters are compared across the ranks (issue 46, case 5). The check raises ReplicaDivergenceError on
        every rank, before the update; the post-hook records the optimizer's own writes.

        ``optimizer.step(closure)`` (LBFGS) gets the closure with its loss summed over the workers (returned:
        the hook's new arguments): each worker's loss is its share of the global batch's (``compute_average_loss``)
        and every gradient the closure's ``backward()`` leaves is the global one, so every worker's optimizer
        sees the loss and gradients of one device on the global batch and takes the same decisions (LBFGS's
        stopping test and line search)."""
        watched = self._synchronizers.before_step(optimizer)
        held = self.agreement.held(optimizer) if watched else None   # one walk of the modules a step
        if held is not None:
            average_mean_buffers(held.mean, self.all_reduce_tensors)
        if watched or not self._synchronizers.live():
            self.agreement.before_step(optimizer, held)
        if watched and self._world > 1:
            return with_global_loss(cast(tuple, args), cast(dict, kwargs), self._global_loss)
        return None

    def _global_loss(self, loss: object) -> object:
        """A closure's loss summed over the workers (every worker calls its closure as often: the same loss and
        gradients everywhere make the same decisions); what is not a tensor (None) is returned as it is."""
        if not isinstance(loss, torch.Tensor):
            return loss
        return self.all_reduce_tensors(ReduceOp.SUM, [loss.detach()])[0]

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.agreement.after_step(optimizer)   # the optimizer's own writes are no news at the next step

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
