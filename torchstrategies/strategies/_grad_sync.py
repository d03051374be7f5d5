"""Bucketed gradient all-reduce overlapped with backward (the engine of MultiWorkerMirroredStrategy).

How it works:

* The trainable parameters are grouped into buckets of about ``bytes_per_pack`` bytes (0: one bucket per
  dtype/device), in reverse registration order, which is roughly the order backward produces gradients.
  Each bucket owns one flat tensor; after a synchronized backward every ``param.grad`` is a view into it,
  and the reduced result lands there (no copy out). A gradient autograd made anew (``zero_grad()`` sets
  them to None) is copied into its view once.
* A ``post_accumulate_grad`` hook per parameter marks it ready; a bucket whose parameters are all ready is
  all-reduced asynchronously right away, buckets always in the same index order on every rank.
* At the end of backward (an autograd engine callback) the buckets that are not complete are launched too:
  a parameter that got no gradient on this rank contributes zeros. Each bucket carries one extra element
  per parameter, a 0/1 "had a gradient" flag, summed with the gradients: a parameter no rank produced a
  gradient for keeps ``grad = None``, as in single-process training. Backward returns with every gradient
  reduced (as DDP does), so ``clip_grad_norm_`` and friends see the global gradients; ``optimizer.step()``
  also waits (a no-op by then).
* Gradients are SUMMED (TF's semantics: the loss carries the 1/global_batch via ``compute_average_loss``).
* ``no_sync()``: hooks only note that local gradients are pending; the next synchronized backward (or the
  next ``optimizer.step()`` if none comes) reduces the accumulated totals once.
* A second synchronized backward before ``optimizer.step()`` keeps the sum right: the already reduced
  gradients are divided by the world size when the new backward starts, so sum(S/n + g_i) = S + sum(g_i).
  The same holds across steps (gradient accumulation without ``zero_grad()``): ``optimizer.step()`` leaves
  the reduced gradients in place, so the next backward rescales them before adding to them.
* Sparse gradients (``nn.Embedding(sparse=True)``) do not go in a bucket: each parameter has a second
  flag, "had a sparse gradient", and after the buckets the sparse ones are summed by ``sparse_sum`` (every
  rank gathers every rank's indices and values).
* The set of synchronized parameters follows the model: at the start of each backward, a parameter of the
  module made trainable since (fine-tuning), or whose dtype, device or shape changed (``model.double()``),
  rebuilds the buckets.
* ``proven(p)``: ``p.grad`` is the tensor the last reduction left there (not replaced). The optimizer's
  step pre-hook (``_step_sync.py``) reduces every other gradient it is about to apply, once.
* Communication is one DDP-style hook, ``hook(state, bucket) -> torch.futures.Future[Tensor]`` (the shape of
  torch's ``ddp_comm_hooks/default_hooks.py``; ``state`` is the strategy's process group, ``bucket`` a
  :class:`GradBucket`). The default, :func:`allreduce_hook`, starts ``dist.all_reduce(..., async_op=True)``
  on the bucket in place and returns its future: the reduction runs while backward goes on, and the end
  of backward waits for it. ``CompressionHook(torch.float16)`` sends the bucket in 16 bits. A hook's
  error travels in its future and is raised at the end of backward, named by the strategy's health
  monitor (``_health.py``).

One gradient's path: autograd -> ``_on_grad_ready`` (its bucket) -> the hook -> ``torch.distributed`` on
the strategy's group -> the backend -> ``_finish`` (end of backward: wait, write back) -> the optimizer.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchstrategies.distribute.replica_share import linear_gradient_hook
from torchstrategies.strategies._health import HealthMonitor

__all__ = ["GradBucket", "GradientSynchronizer", "Hook", "SyncState", "allreduce_hook", "CompressionHook",
           "sparse_sum"]

log = logging.getLogger("torchstrategies.multi_worker")


class SyncState(enum.Enum):
    """Where a :class:`GradientSynchronizer` is in its step. Each transition is one method (docs/architecture.md
    draws them): ``_rebuilt`` (any -> IDLE), ``_begin`` (IDLE -> BACKWARD), ``_reduced`` (BACKWARD, IDLE or
    REDUCED -> REDUCED), ``_unreduce`` (REDUCED -> IDLE), ``_abandon`` (BACKWARD -> IDLE)."""

    IDLE = "idle"  # no reduction under way; the gradients are not known to be reduced
    BACKWARD = "backward"  # a synchronized backward is under way: full buckets are sent as they fill
    REDUCED = "reduced"  # every synchronized gradient is what the last reduction left (``proven``)


class GradBucket:
    """What a communication hook receives: one flat gradient buffer (torch's ``dist.GradBucket`` methods).

    Args:
        index: the bucket's position (buckets are launched in index order on every rank).
        buffer: the flat tensor holding the bucket's gradients, then one 0/1 flag per parameter.
        parameters: the bucket's parameters, in buffer order.
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list[torch.Tensor] | None = None) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters or []

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)


Hook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def allreduce_hook(group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The default hook: the bucket SUMMED over the group in place; the future's value is the buffer.

    Unlike torch's ``default_hooks.allreduce_hook`` it does not divide by the world size (TF's SUM).
    """
    buf = bucket.buffer()
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()  # type: ignore[union-attr]
    return fut.then(lambda f: f.value()[0])


class CompressionHook:
    """A hook that sends each bucket in 16 bits and sums the workers' copies in the bucket's dtype.

    Every rank rounds its bucket once to ``dtype``, the ranks all-gather the 16-bit buffers, and every rank
    sums them in rank order (so all ranks get the same bits). Error bound per element:
    ``|reduced - exact| <= u * sum_i |g_i| + n * 2**-24 * sum_i |g_i| + n * a`` with ``u = 2**-11``
    (float16) or ``2**-8`` (bfloat16) and ``a`` the type's underflow step; float16 overflows beyond 65504.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"compression dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype

    def __call__(self, group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        flat = bucket.buffer()
        small = flat.to(self.dtype)
        gathered = torch.empty(group.size() * small.numel(), dtype=self.dtype, device=flat.device)
        work = dist.all_gather_single(gathered, small, group=group, async_op=True)

        def total(f: torch.futures.Future[Any]) -> torch.Tensor:
            f.value()  # raises the collective's error
            parts = gathered.view(group.size(), -1)
            flat.copy_(parts[0])
            for p in parts[1:]:
                flat.add_(p)
            return flat

        return work.get_future().then(total)  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"CompressionHook({self.dtype})"


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index = index
        self.refs = [weakref.ref(p) for p in params]
        p0 = params[0]
        self.numels = [p.numel() for p in params]
        self.offsets = []
        off = 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.total = off
        # Gradients first, then one flag per parameter.
        # Gradients first, then one "had a gradient" flag per parameter, then one "had a sparse gradient".
        self.flat = torch.zeros(off + 2 * len(params), dtype=p0.dtype, device=p0.device)
        self.views = [self.flat[o:o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, params)]
        self.flags = self.flat[off:]
        self.sparse_grads: list[torch.Tensor | None] = [None] * len(params)  # what the last reduction left
        self.reset()

    @property
    def params(self) -> list[torch.nn.Parameter | None]:
        """The bucket's parameters in buffer order; None for one that was freed."""
        return [r() for r in self.refs]

    def reset(self) -> None:
        self.ready = [False] * len(self.refs)
        self.had_grad = [False] * len(self.refs)
        self.had_sparse = [False] * len(self.refs)
        self.pending = len(self.refs)
        self.launched = False
        self.future: torch.futures.Future[torch.Tensor] | None = None


class GradientSynchronizer:
    """Sums the gradients of ``params`` across workers during backward, through a communication hook.

    Args:
        params: a module's parameters: those with ``requires_grad`` are synchronized, the others are
            watched (made trainable later, they join at the next backward).
        group: the strategy's process group (the hook's ``state``).
        bytes_per_pack: bucket size in bytes; 0 puts each dtype/device group in one bucket.
        hook: ``hook(state, bucket) -> Future``; default ``allreduce_hook``.
        health: the strategy's ``HealthMonitor``: counts the collectives, names the rank behind a failure.
        autograd_hooks: False: no hooks on the parameters; ``reduce_now`` reduces whatever gradients they
            hold (the optimizer step's reduction of gradients no backward reduced).
        name_of: a parameter's name for an error (default: its shape).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, bytes_per_pack: int = 0,
                 hook: Hook | None = None, health: HealthMonitor | None = None, autograd_hooks: bool = True,
                 name_of: Callable[[torch.Tensor], str] | None = None):
        if not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {bytes_per_pack!r}")
        self.state = group
        self.hook: Hook = hook if hook is not None else allreduce_hook
        self.health = health
        self.world_size = group.size()
        self.bytes_per_pack = bytes_per_pack
        seen: set[int] = set()
        plist = []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                plist.append(p)
        # Weak: the parameters own the synchronizer (through their hooks), not the other way round, so a
        # dropped model frees its parameters, and the strategy forgets a synchronizer whose are all gone.
        self._all_refs = [weakref.ref(p) for p in plist]
        self._all_by_id = {id(p): r for p, r in zip(plist, self._all_refs)}
        self._autograd_hooks = autograd_hooks
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._next_launch = 0
        self._sync_enabled = True
        self._local_pending = False  # gradients accumulated under no_sync, not yet reduced
        self._callback_queued = False
        self.num_reductions = 0  # buckets reduced so far (tests and benchmarks read it)
        self._name_of = name_of or (lambda p: f"of shape {tuple(p.shape)}")
        self._changes: list[str] = []  # how this rank's parameters changed since the last reduction
        self._layout: list[tuple[Any, Any, Any]] = []  # (dtype, device, shape) of each synchronized parameter
        self._set_buckets()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The synchronized parameters that are still alive."""
        return [p for p in (r() for r in self._refs) if p is not None]

    @property
    def alive(self) -> bool:
        return any(r() is not None for r in self._all_refs)

    # --- set-up --------------------------------------------------------------------------------------------
    def _wanted(self) -> list[torch.nn.Parameter]:
        every = [p for p in (r() for r in self._all_refs) if p is not None]
        return every if not self._autograd_hooks else [p for p in every if p.requires_grad]

    def _set_buckets(self) -> None:
        """(Re)builds the buckets for the parameters wanted now; a gradient that was reduced stays reduced
        (copied into its new view); hooks go on the parameters that lack them."""
        old = [(p, p.grad) for p in self.params if p.grad is not None and self.proven(p)] \
            if hasattr(self, "buckets") else []
        plist = self._wanted()
        if hasattr(self, "buckets"):
            self._changes += _changes(self.params, self._layout, plist, self._name_of)
        self._refs = [weakref.ref(p) for p in plist]
        self.buckets = self._make_buckets(list(reversed(plist)))
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._layout = [(p.dtype, p.device, p.shape) for p in plist]
        self._rebuilt()
        for p in plist:
            if self._autograd_hooks and id(p) not in self._hooked:
                self._hooked.add(id(p))
                self._hooks.append(p.register_hook(linear_gradient_hook(self._make_pre_hook())))
                self._hooks.append(p.register_post_accumulate_grad_hook(  # (the strategy's own: not guarded)
                    linear_gradient_hook(self._on_grad_ready)))
        for p, g in old:
            if self._located(p) is not None:
                self._keep_reduced(p, g)
        if old:
            self._reduced()

    def _layout_changed(self) -> bool:
        """Whether a watched parameter became (un)trainable or changed dtype, device or shape."""
        wanted = self._wanted()
        if len(wanted) != len(self._refs):
            return True
        for p, ref, (dtype, device, shape) in zip(wanted, self._refs, self._layout):
            if p is not ref() or p.dtype != dtype or p.device != device or p.shape != shape:
                return True
        return False

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of this synchronizer's (watched) parameters (by identity: a new tensor
        that got the ``id()`` of a freed one is not)."""
        ref = self._all_by_id.get(id(param))
        return ref is not None and ref() is param

    def _located(self, param: torch.Tensor) -> tuple[_Bucket, int] | None:
        """``param``'s bucket and index, if it is in a bucket now (by identity, as ``owns``)."""
        where = self._where.get(id(param))
        if where is None or where[0].refs[where[1]]() is not param:
            return None
        return where

    def synchronizes(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is in a bucket now (trainable, watched)."""
        return self._located(param) is not None

    def proven(self, param: torch.Tensor) -> bool:
        """Whether ``param.grad`` is what the last reduction left there (so reducing it again would count
        it twice): the reduced bucket view, or the reduced sparse tensor, not replaced since."""
        where = self._located(param)
        if where is None or self._state is not SyncState.REDUCED:
            return False
        g = param.grad
        if g is None:
            return False
        b, i = where
        view = b.views[i]
        if g is view:
            return True
        if g.layout != torch.strided:
            return g is b.sparse_grads[i]
        return g.data_ptr() == view.data_ptr() and g.shape == view.shape and g.dtype == view.dtype

    def _keep_reduced(self, param: torch.Tensor, g: torch.Tensor) -> None:
        """Makes ``g`` (a reduced gradient) ``param``'s gradient in this synchronizer's bucket."""
        b, i = self._where[id(param)]
        if g.layout != torch.strided:
            param.grad = g
            b.sparse_grads[i] = g
            return
        view = b.views[i]
        if g.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(g)
        param.grad = view

    def take_reduced(self, params: list[torch.nn.Parameter]) -> None:
        """``params``' gradients were just reduced elsewhere (at the optimizer step): they become this
        synchronizer's reduced gradients (rebuilding the buckets first if the model changed)."""
        if self._layout_changed():
            self._set_buckets()
        for p in params:
            if self._located(p) is not None and p.grad is not None:
                self._keep_reduced(p, p.grad)
        self._reduced()

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[_Bucket]:
        groups: dict[tuple[Any, Any], list[list[torch.nn.Parameter]]] = {}
        order: list[tuple[Any, Any]] = []
        for p in params:
            key = (p.device, p.dtype)
            if key not in groups:
                groups[key] = [[]]
                order.append(key)
            cur = groups[key][-1]
            size = sum(q.numel() for q in cur) * p.element_size()
            if cur and self.bytes_per_pack and size + p.numel() * p.element_size() > self.bytes_per_pack:
                groups[key].append([p])
            else:
                cur.append(p)
        buckets: list[_Bucket] = []
        compressed = getattr(self.hook, "dtype", None) is not None
        for key in order:
            for plist in groups[key]:
                if compressed and not plist[0].dtype.is_floating_point:
                    raise ValueError(f"gradient compression needs floating-point parameters, got {plist[0].dtype}")
                buckets.append(_Bucket(len(buckets), plist))
        return buckets

    def set_hook(self, hook: Hook) -> None:
        """Replaces the communication hook (between steps)."""
        if self._state is SyncState.BACKWARD:
            raise RuntimeError("cannot change the communication hook during backward")
        self.hook = hook
        self._set_buckets()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._hooked.clear()

    def reduce_now(self) -> None:
        """Reduces the gradients the parameters hold now, as the end of a backward would."""
        self._begin()
        self._finish()

    # --- public controls -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = prev

    def before_step(self) -> None:
        """Called before ``optimizer.step()``: reduces what no_sync left pending and waits for everything.

        After the step the reduced gradients stay in ``.grad`` (the state stays REDUCED), so a backward
        without ``zero_grad()`` in between adds to them as a second backward does."""
        if self._state is SyncState.BACKWARD:
            self._finish()
        elif self._state is SyncState.IDLE and self._local_pending and self._sync_enabled:
            self.reduce_now()

    # --- hooks ---------------------------------------------------------------------------------------------
    def _make_pre_hook(self) -> Any:
        def pre_hook(grad: torch.Tensor) -> None:
            if self._state is SyncState.REDUCED:
                self._unreduce()
            return None

        return pre_hook

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_enabled:
            self._local_pending = True
            return
        if self._state is not SyncState.BACKWARD:
            self._begin()
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket, i = self._where[id(param)]
        if bucket.ready[i]:
            if bucket.launched:  # a second accumulation after its bucket was sent: it would be lost
                self._abandon()
                raise RuntimeError(
                    f"A gradient of a parameter of shape {tuple(param.shape)} was accumulated twice in one "
                    "backward, after its bucket was sent to the other workers: a backward inside a backward "
                    "(torch.utils.checkpoint with use_reentrant=True over a parameter also used outside the "
                    "checkpoint) is not supported by MultiWorkerMirroredStrategy (nor by DDP); use "
                    "checkpoint(..., use_reentrant=False)")
            return  # accumulated in place into its view before the bucket left: nothing new
        self._take_grad(bucket, i, param)
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:  # (otherwise nothing new can be launched)
            self._launch_ready()

    # --- the per-iteration state machine (SyncState: each transition is one of these methods) -------------
    def _rebuilt(self) -> None:
        """Any -> IDLE: the buckets were (re)built (the gradients that stay reduced are taken next)."""
        self._state = SyncState.IDLE

    def _begin(self) -> None:
        """IDLE (or REDUCED, for ``reduce_now``) -> BACKWARD: every bucket empty, none sent."""
        if self._layout_changed():
            self._set_buckets()
        for b in self.buckets:
            b.reset()
        self._next_launch = 0
        self._state = SyncState.BACKWARD

    def _reduced(self) -> None:
        """-> REDUCED: the synchronized gradients are the reduced ones (``proven``)."""
        self._state = SyncState.REDUCED

    def _unreduce(self) -> None:
        """REDUCED -> IDLE: a new synchronized backward on top of already reduced gradients (no step in
        between) divides them by the world size, so the next reduction sums them once."""
        world = float(self.world_size)
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(world)
        self._state = SyncState.IDLE
        self._local_pending = True

    def _abandon(self) -> None:
        """BACKWARD -> IDLE: the backward's reduction failed (its error is being raised)."""
        self._state = SyncState.IDLE

    def _take_grad(self, bucket: _Bucket, i: int, param: torch.Tensor | None) -> None:
        view = bucket.views[i]
        g = None if param is None else param.grad
        bucket.had_sparse[i] = g is not None and g.layout != torch.strided
        if param is None or g is None or bucket.had_sparse[i]:
            view.zero_()
            bucket.had_grad[i] = False
            return
        if g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)
            param.grad = view
        bucket.had_grad[i] = True

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        if self.health is not None:
            self.health.seq += 1
        b.flags.copy_(torch.tensor(b.had_grad + b.had_sparse, dtype=b.flags.dtype), non_blocking=True)
        try:
            b.future = self.hook(self.state, GradBucket(b.index, b.flat, [p for p in b.params if p is not None]))
        except Exception as exc:  # noqa: BLE001 - raised at the end of backward, like an asynchronous error
            b.future = torch.futures.Future()
            b.future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the value type
        b.launched = True

    def _finish(self) -> None:
        """End of backward: launch what is left (missing gradients count as zero), wait, write back."""
        self._callback_queued = False
        if self._state is not SyncState.BACKWARD:
            return
        for b in self.buckets[self._next_launch:]:
            for i, p in enumerate(b.params):
                if not b.ready[i]:
                    self._take_grad(b, i, p)
                    b.ready[i] = True
            b.pending = 0
        self._launch_ready()
        sparse: list[tuple[_Bucket, int, torch.nn.Parameter]] = []
        for b in self.buckets:
            assert b.future is not None
            try:
                result = b.future.wait()
            except Exception as exc:
                self._abandon()
                if self.health is None or type(exc).__module__.startswith("torchstrategies") or not isinstance(
                        exc, (RuntimeError, TimeoutError)):
                    raise
                named = self.health.diagnose(exc, f"gradient all-reduce (bucket {b.index} of {len(self.buckets)})")
                if isinstance(named, ValueError):  # the backend's collective mismatch
                    raise ValueError(self._mismatch_cause(named)) from exc
                raise named from exc
            b.future = None
            if not isinstance(result, torch.Tensor) or result.shape != b.flat.shape:
                raise TypeError(f"a communication hook's future must hold the reduced bucket, a tensor of shape "
                                f"{tuple(b.flat.shape)}; {self.hook!r} gave {type(result).__name__}")
            if result.data_ptr() != b.flat.data_ptr():
                b.flat.copy_(result)
            flags = b.flags.tolist()
            n = len(b.refs)
            for i, p in enumerate(b.params):
                if p is None:
                    continue
                if flags[n + i] > 0.5:  # some rank had a sparse gradient
                    sparse.append((b, i, p))
                elif flags[i] > 0.5:
                    if p.grad is None or p.grad.data_ptr() != b.views[i].data_ptr():
                        p.grad = b.views[i]
                else:
                    p.grad = None  # no rank had a gradient for it
            self.num_reductions += 1
        for b, i, p in sparse:
            g = p.grad if p.grad is not None and p.grad.layout != torch.strided else None
            p.grad = b.sparse_grads[i] = sparse_sum(g, p, self.state)
        self._local_pending = False
        self._reduced()
        self._changes = []

    def _mismatch_cause(self, named: Exception) -> str:
        """The backend's "collective mismatch" of a gradient all-reduce, with what this rank changed."""
        rank = self.state.rank()
        fix = ("Freeze or unfreeze a parameter (requires_grad_), or change its dtype, device or shape, on every "
               "rank in the same step: run the same code on every rank")
        if self._changes:
            return (f"The ranks synchronize different parameters: on rank {rank}, since the last gradient "
                    f"all-reduce, {'; '.join(self._changes)}, and the other ranks did not do the same. {fix}. "
                    f"({named})")
        return (f"The ranks synchronize different parameters: rank {rank}'s did not change since the last "
                "gradient all-reduce, so another rank froze or unfroze one (requires_grad_) or changed its dtype, "
                f"device or shape on its own (that rank's error names it). {fix}. ({named})")


def _changes(before: list[torch.nn.Parameter], layout: list[tuple[Any, Any, Any]], now: list[torch.nn.Parameter],
             name_of: Callable[[torch.Tensor], str]) -> list[str]:
    """What made the synchronized parameters ``now`` differ from ``before`` (with their ``layout``)."""
    old = {id(p): (p, lay) for p, lay in zip(before, layout)}
    new = {id(p) for p in now}
    out = []
    for p, (dtype, device, shape) in old.values():
        if id(p) not in new:
            out.append(f"parameter {name_of(p)} was frozen (requires_grad_(False))")
        elif (p.dtype, p.device, p.shape) != (dtype, device, shape):
            out.append(f"parameter {name_of(p)} changed from {dtype}/{device}/{tuple(shape)} to "
                       f"{p.dtype}/{p.device}/{tuple(p.shape)}")
    out += [f"parameter {name_of(p)} was made trainable (requires_grad_(True))" for p in now if id(p) not in old]
    return out


def sparse_sum(grad: torch.Tensor | None, param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of a sparse COO gradient (None: this rank has none): every rank gathers every
    rank's indices and values and coalesces them, so all ranks get the same tensor."""
    if grad is None:
        sparse_dim = 1
        dense = param.shape[sparse_dim:]
        grad = torch.sparse_coo_tensor(torch.empty(sparse_dim, 0, dtype=torch.long, device=param.device),
                                       torch.empty(0, *dense, dtype=param.dtype, device=param.device),
                                       param.shape)
    grad = grad.coalesce()
    indices, values = grad.indices(), grad.values()
    world = group.size()
    counts = [torch.zeros(1, dtype=torch.long, device=indices.device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([indices.shape[1]], dtype=torch.long, device=indices.device), group=group)
    most = int(max(int(c) for c in counts))
    pad = most - indices.shape[1]
    idx = torch.cat([indices, indices.new_zeros(indices.shape[0], pad)], 1)
    val = torch.cat([values, values.new_zeros(pad, *values.shape[1:])], 0)
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    all_val = [torch.empty_like(val) for _ in range(world)]
    dist.all_gather(all_idx, idx, group=group)
    dist.all_gather(all_val, val, group=group)
    used = [int(c) for c in counts]
    total = torch.sparse_coo_tensor(torch.cat([x[:, :k] for x, k in zip(all_idx, used)], 1),
                                    torch.cat([v[:k] for v, k in zip(all_val, used)], 0), grad.shape)
    return total.coalesce()
