"""How a MultiWorkerMirroredStrategy's process joins the job: the cluster resolver (torchrun's environment,
``TF_CONFIG``, or the process group already initialized), this worker's device (``cuda:LOCAL_RANK`` or the
CPU), and the default process group when the caller has not initialized one (gloo on CPU, NCCL on CUDA,
over a rendezvous store of this launch attempt's own, timeout from ``communication_options``)."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from torchstrategies.cluster_resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
)
from torchstrategies.collectives import CommunicationOptions
from torchstrategies.errors import UnavailableError

__all__ = ["JoinedCluster", "join_cluster", "import_dynamo_first"]


@dataclasses.dataclass(frozen=True)
class JoinedCluster:
    """What joining gave the strategy."""

    resolver: ClusterResolver
    device: torch.device
    store: dist.Store | None  # the rendezvous store of the default group it made, else None
    owns_process_group: bool  # it initialized the default process group (its shutdown destroys it)


def join_cluster(cluster_resolver: ClusterResolver | None, process_group: dist.ProcessGroup | None,
                 options: CommunicationOptions) -> JoinedCluster:
    """Picks the device and the resolver, and initializes the default process group if nobody has;
    checks that the resolver and an existing process group agree on this rank and the world."""
    store: dist.Store | None = None
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
    device = _pick_device(cluster_resolver)
    import_dynamo_first()
    if not dist.is_initialized():
        store = _init_process_group(cluster_resolver, device, options)
        rank, world = dist.get_rank(), dist.get_world_size()
    elif cluster_resolver.world_size != world or cluster_resolver.rank != rank:
        raise ValueError(
            f"the cluster resolver says rank {cluster_resolver.rank} of {cluster_resolver.world_size}, but the "
            f"initialized process group is rank {rank} of {world}")
    if process_group is not None and process_group.size() != world:
        raise ValueError(f"MultiWorkerMirroredStrategy spans every worker: process_group has "
                         f"{process_group.size()} of the {world} ranks")
    return JoinedCluster(cluster_resolver, device, store, owns_process_group=store is not None)


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


def _init_process_group(resolver: ClusterResolver, device: torch.device,
                        options: CommunicationOptions) -> dist.Store:
    """Initializes the default process group over a store of this attempt's own (returned)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        addr, port = resolver.master_addr, resolver.master_port
        rank, world = resolver.rank, resolver.world_size
    except ValueError as exc:
        raise ValueError(f"MultiWorkerMirroredStrategy cannot find the cluster: {exc}") from None
    timeout = None
    if options.timeout_seconds is not None:
        timeout = datetime.timedelta(seconds=float(options.timeout_seconds))
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
                            device_id=device if device.type == "cuda" else None)
    return store


def _default_resolver() -> ClusterResolver:
    if "RANK" in os.environ or "TF_CONFIG" not in os.environ:
        return TorchrunClusterResolver()
    return TFConfigClusterResolver()


def import_dynamo_first() -> None:
    """Imports torch._dynamo before the strategy makes any process group.

    torch 2.13 keeps a process group that existed when torch._dynamo was first imported alive after
    ``destroy_process_group()`` (references from C++, found by experiment). Creating any torch optimizer
    imports torch._dynamo (about 1.3 s), which users do right after making the strategy. A gloo group kept
    alive that way still has its worker threads at interpreter exit; one that frees its last work item
    during finalization aborts the process ("terminate called without an active exception", exit -6 under
    torchrun). Importing it first costs nothing extra when an optimizer follows, and lets ``shutdown()``
    free the groups and their threads. Whoever makes a group with ``dist.init_process_group`` (the bench
    workers, ``integrations.init_process_group``) calls it first too.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch without dynamo has nothing to capture the group either
        pass
