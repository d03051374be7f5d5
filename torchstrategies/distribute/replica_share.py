"""Gradient computations that see one replica's share of the batch where one device sees the global batch:
named on first use, with what to do.

Every replica computes the gradient of its own rows; the strategy sums them. Whatever acts on a replica's
gradient before that sum gets ``g_r`` where one device gets ``sum_r g_r``: right when it is linear in the
gradient (a scale, a mask), wrong otherwise, and which it is can not be seen from the outside. So:

* a gradient hook on a parameter (``p.register_hook(fn)``, and ``p.register_post_accumulate_grad_hook(fn)``,
  which runs when the replica's share has accumulated in ``p.grad``) raises ``RuntimeError`` the first time it runs
  on a replica's share (in-process: inside a replica of a strategy with several; MultiWorkerMirrored: on a
  parameter it synchronizes, with several workers), unless it was declared linear with
  :func:`linear_gradient_hook` (then it is right as it is: ``sum_r fn(g_r) = fn(sum_r g_r)``);
* ``nn.Embedding(scale_grad_by_freq=True)`` (``F.embedding`` / ``F.embedding_bag`` with it) raises in a
  training forward on such a parameter: it divides each row's gradient by that row's count in the
  replica's batch, not in the global batch;
* ``optimizer.step(closure)``: the optimizer acts on the loss the closure returns (LBFGS's stopping test and
  line search), which is the replica's share, not the global loss. MultiWorkerMirrored gives the optimizer
  the closure with its loss summed over the workers (:func:`with_global_loss`: one device's loss, as the
  gradients are one device's); inside ``run`` of an in-process strategy, whose replicas share one optimizer
  and call it once in a merge, it raises ``ValueError(STEP_CLOSURE)``.

The strategies install the wrappers (``guard_register_hook``, ``guard_embedding``) with a predicate
``shared(param)``: "is this parameter's gradient a replica's share now".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["STEP_CLOSURE", "StepArgs", "guard_embedding", "guard_register_hook", "is_linear_gradient_hook",
           "linear_gradient_hook", "with_global_loss"]

_LINEAR = "_torchstrategies_linear_gradient_hook"

STEP_CLOSURE = (
    "optimizer.step(closure) is not supported inside run of a strategy with several replicas in one process: "
    "the replicas share the optimizer and step it once, in a merge, while the closure would compute one "
    "replica's share of the global batch's loss (e.g. LBFGS's stopping test and line search act on it). "
    "Compute the loss and call backward() in the step function, then call optimizer.step() without a "
    "closure; an optimizer that needs one, such as LBFGS, trains under MultiWorkerMirroredStrategy (one "
    "process per replica), where the closure's loss is summed over the workers"
)

# An optimizer step pre-hook's (args, kwargs): args[0] is the optimizer, args[1] (or kwargs["closure"]) the closure.
StepArgs = tuple[tuple[Any, ...], dict[str, Any]]


def with_global_loss(args: tuple[Any, ...], kwargs: dict[str, Any],
                     reduce: Callable[[Any], Any]) -> StepArgs | None:
    """For ``optimizer.step(closure)``: the pre-hook's new arguments, with the closure wrapped so that the loss it
    returns is ``reduce(loss)`` (the loss summed over the workers); None for a step without a closure."""
    def wrap(closure: Callable[[], Any]) -> Callable[[], Any]:
        @functools.wraps(closure)
        def global_closure() -> Any:
            return reduce(closure())
        return global_closure

    if len(args) > 1 and args[1] is not None:
        return (args[0], wrap(args[1]), *args[2:]), kwargs
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": wrap(kwargs["closure"])}
    return None

Shared = Callable[[torch.Tensor], bool]


def linear_gradient_hook(hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """Declares a gradient hook linear in the gradient (a scale, a mask, a projection), so that under a
    strategy with several replicas it may run on each replica's share: the sum of its results is its result
    on the global gradient, as on one device.

    Example:
        >>> import torch, torchstrategies as ts
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> handle = p.register_hook(ts.linear_gradient_hook(lambda g: g * 0.5))
    """

    @functools.wraps(hook)
    def linear(grad: torch.Tensor) -> Any:
        return hook(grad)

    setattr(linear, _LINEAR, True)
    return linear


def is_linear_gradient_hook(hook: object) -> bool:
    return bool(getattr(hook, _LINEAR, False))


def _hook_error(param: torch.Tensor, hook: object, post_accumulate: bool) -> RuntimeError:
    name = getattr(hook, "__qualname__", None) or repr(hook)
    if post_accumulate:
        return RuntimeError(
            f"The post-accumulate-grad hook {name} on a parameter of shape {tuple(param.shape)} runs when this "
            "replica's share of the gradient (the gradient of its rows) has accumulated in p.grad, before the "
            "strategy sums the replicas' shares, not on the global batch's gradient as on one device: what it does "
            "with p.grad (clipping, an optimizer step fused into backward) acts on a share. Do it after "
            "loss.backward(), where every .grad is the global gradient (e.g. call the per-parameter optimizers' "
            "step() there). A hook linear in the gradient (scaling p.grad in place): declare it, "
            "p.register_post_accumulate_grad_hook(ts.linear_gradient_hook(fn))"
        )
    return RuntimeError(
        f"The gradient hook {name} on a parameter of shape {tuple(param.shape)} runs on each replica's share of "
        "the gradient (the gradient of that replica's rows), not on the global batch's as on one device; the "
        "strategy sums what it returns. That is right only for a hook linear in the gradient. A non-linear one "
        "(clamp, clipping, normalization, a threshold): apply it to p.grad between loss.backward() and "
        "optimizer.step(), where every .grad is the global gradient (e.g. p.grad.clamp_(-c, c)). A linear one "
        "(a scale, a mask): declare it, p.register_hook(ts.linear_gradient_hook(fn))"
    )


def guard_register_hook(shared: Shared, post_accumulate: bool = False
                        ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of ``torch.Tensor.register_hook`` (``post_accumulate``: of
    ``register_post_accumulate_grad_hook``, whose hook gets the parameter after its ``.grad`` accumulated): a
    hook on a parameter that is not declared linear raises when it runs on a replica's share
    (``shared(param)``). The strategies' own hooks are declared linear."""

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def register_hook(self: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
            if not isinstance(self, torch.nn.Parameter) or is_linear_gradient_hook(hook):
                return orig(self, hook)
            param = self

            @functools.wraps(hook)
            def checked(arg: torch.Tensor) -> Any:   # (the gradient, or the parameter after accumulation)
                if shared(param):
                    raise _hook_error(param, hook, post_accumulate)
                return hook(arg)

            return orig(self, checked)

        return register_hook

    return wrap


def guard_embedding(shared: Shared) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The wrapper of ``F.embedding`` / ``F.embedding_bag``: ``scale_grad_by_freq=True`` in a forward that
    records a gradient for a shared weight raises."""

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def embedding(input: Any, weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if (_scales_by_freq(orig, args, kwargs) and torch.is_grad_enabled() and weight.requires_grad
                    and shared(weight)):
                module = "EmbeddingBag" if orig.__name__ == "embedding_bag" else "Embedding"
                raise RuntimeError(
                    f"nn.{module}(..., scale_grad_by_freq=True) (F.{orig.__name__}) on a weight of shape "
                    f"{tuple(weight.shape)} under a strategy with several replicas divides each row's "
                    "gradient by that row's count in the replica's share of the batch, not in the global batch as "
                    "on one device, so the replicas' summed gradient differs from one device's. Use "
                    "scale_grad_by_freq=False, or count the rows over the global batch and scale the gradient "
                    "rows yourself between loss.backward() and optimizer.step()")
            return orig(input, weight, *args, **kwargs)

        return embedding

    return wrap


# ``scale_grad_by_freq``'s position after (input, weight) in F.embedding and F.embedding_bag.
_FREQ_POSITION = {"embedding": 3, "embedding_bag": 3}


def _scales_by_freq(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if "scale_grad_by_freq" in kwargs:
        return bool(kwargs["scale_grad_by_freq"])
    position = _FREQ_POSITION.get(fn.__name__, -1)
    return 0 <= position < len(args) and bool(args[position])
