"""``ts.nn.SyncBatchNorm``: batch normalization whose statistics cover every replica of the current strategy.

TF's ``BatchNormalization(synchronized=True)`` for torchstrategies, with ``torch.nn.SyncBatchNorm``'s
signature and state_dict keys. Inside ``strategy.run`` in training mode it all-reduces the batch statistics
over all replicas (MirroredStrategy / CentralStorageStrategy threads, MultiWorkerMirroredStrategy processes)
through the replica context's ``all_reduce``, so the strategy's own reduction path (its CrossDeviceOps or
collectives) carries them; backward all-reduces the two per-channel gradient sums. The math is in
``_sync_bn_function.py``. Elsewhere (no strategy, one replica, cross-replica context, eval mode) it is
plain ``BatchNorm``: running statistics in eval mode, no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from torchstrategies.distribute import context
from torchstrategies.distribute.distribute_lib import ReplicaContext
from torchstrategies.distribute.mirrored_run import acting_for, current_replica
from torchstrategies.nn._sync_bn_function import sync_batch_norm
from torchstrategies.reduce_op import ReduceOp

__all__ = ["SyncBatchNorm"]


class _ReplicaCommunicator:
    """Sums tensors over the replicas of ``replica_context``, from the replica's own thread or from the
    thread autograd runs its backward on (a CUDA device thread, or a thread the user started)."""

    def __init__(self, replica_context: ReplicaContext):
        self._rc = replica_context
        self._replica = current_replica()
        self.num_replicas = replica_context.num_replicas_in_sync
        self.replica_id = replica_context.replica_id_in_sync_group

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if context.get_replica_context() is self._rc:
            return self._rc.all_reduce(ReduceOp.SUM, tensor)
        with acting_for(self._replica), ReplicaContext(self._rc.strategy, self.replica_id) as rc:
            return rc.all_reduce(ReduceOp.SUM, tensor)


def _check_process_group(process_group: object) -> None:
    if process_group is not None:
        raise ValueError(
            "ts.nn.SyncBatchNorm synchronizes over the replicas of the current strategy; process_group "
            f"must be None, got {process_group!r}"
        )


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of all replicas (``torch.nn.SyncBatchNorm``'s signature).

    Args:
        num_features: number of channels ``C`` of the ``(N, C, ...)`` input.
        eps: added to the variance for numerical stability.
        momentum: running statistics factor; None: cumulative average.
        affine: learnable ``weight`` and ``bias``.
        track_running_stats: keep ``running_mean``/``running_var`` (updated with the unbiased GLOBAL
            variance) and ``num_batches_tracked``.
        process_group: must be None: the replicas are the current strategy's (accepted for signature
            compatibility).
        device, dtype: where and how the parameters and buffers are created.
        bias: keyword-only; False drops the learnable bias (as in torch).

    Raises:
        ValueError: a ``process_group``; at call time an input with fewer than 2 dimensions, zero or the
            wrong number of channels, or a training batch with fewer than 2 values per channel in total.

    Example:
        >>> import torch, torchstrategies as ts
        >>> s = ts.MirroredStrategy(num_replicas=2)
        >>> with s.scope():
        ...     bn = ts.nn.SyncBatchNorm(3)
        >>> x = torch.randn(8, 3, 4, 4)
        >>> halves = lambda c: x[4 * c.replica_id_in_sync_group :][:4]
        >>> parts = s.experimental_distribute_values_from_function(halves)
        >>> out = s.gather(s.run(bn, args=(parts,)), axis=0)
        >>> torch.testing.assert_close(out, torch.nn.functional.batch_norm(x, None, None, training=True))
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: object = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        _check_process_group(process_group)
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {num_features!r}")
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, bias=bias
        )
        self.process_group = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}D "
                f"input of shape {tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm(num_features={self.num_features}) expected {self.num_features} channels in "
                f"dim 1 of the input, got {input.shape[1]} (input shape {tuple(input.shape)})"
            )

    def _replica_communicator(self) -> _ReplicaCommunicator | None:
        mode = context.current_mode()
        rc = mode.replica_context
        if rc is None or mode.cross_replica is not None or rc.num_replicas_in_sync < 2:
            return None
        return _ReplicaCommunicator(rc)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        comm = self._replica_communicator() if self.training else None
        if comm is None:
            track = not self.training or self.track_running_stats
            return F.batch_norm(
                input,
                self.running_mean if track else None,
                self.running_var if track else None,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
            )
        out, mean, var, total = sync_batch_norm(input, self.weight, self.bias, self.eps, comm)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                rm, rv = self.running_mean, self.running_var
                rm.mul_(1.0 - factor).add_(mean.to(rm.dtype), alpha=factor)
                rv.mul_(1.0 - factor).add_((var * (total / (total - 1))).to(rv.dtype), alpha=factor)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: object = None) -> torch.nn.Module:
        """Replaces every ``BatchNorm1d/2d/3d`` (any ``_BatchNorm``) in ``module`` by ``ts.nn.SyncBatchNorm``.

        The new layers take over the old ones' parameters and buffers (the same tensors) and training flag,
        as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does. Returns ``module`` with the layers
        replaced, or the new layer when ``module`` itself is a batch norm.

        Example:
            >>> import torch, torchstrategies as ts
            >>> net = ts.nn.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
            >>> type(net[0]).__name__
            'SyncBatchNorm'
        """
        _check_process_group(process_group)
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                bias=module.bias is not None,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
