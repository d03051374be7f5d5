"""The chief's FunctionCache: a scheduled function is pickled once, and the closures it sends mean the same.

Most tests drive the chief's ``Registry.dumps_closure`` (what ``schedule`` calls) against a registry whose ps
calls do nothing, and load the closure with the worker's own unpickler, so they check what a worker would
run. One test runs a real cluster (chief, 1 ps, 1 worker): rebound globals, closure variables and lists
mutated in place reach the worker, and training with the cache equals training without it.
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch
from _ps_bodies import serve_or_train
from harness import run_ranks

import torchstrategies as ts
from torchstrategies.parameter_server.registry import Registry
from torchstrategies.parameter_server.worker_runtime import _Unpickler

os.environ.setdefault("TORCHSTRATEGIES_PS_SECRET", "test-job-secret-0123456789abcdef")   # the launch sets it

SCALE = 2
HELPER_OFFSET = 0
ITEMS = [1, 2]


def _registry() -> Registry:
    return Registry(strategy=object(), num_ps=1, ps_call=lambda ps, header, tensors: ({}, []))


def _run(reg: Registry, fn, args=(), kwargs=None):
    """Pickles the closure as schedule() does and runs it as a worker would."""
    blob, _, _ = reg.dumps_closure(fn, tuple(args), dict(kwargs or {}))
    entry = reg.function_cache._entries.get(getattr(fn, "__code__", None))
    if entry is not None and reg.function_cache.fingerprint(fn) is not None:
        assert entry.blob == reg.dumps(fn)[0]    # what the cache sends is what pickling afresh gives
    f, a, k = _Unpickler(blob, None).load()  # type: ignore[arg-type]
    return f(*a, **k)


def _scaled():
    def scaled(x):
        return x * SCALE
    return scaled


def test_unchanged_function_is_pickled_once_and_its_bytes_equal_a_fresh_pickle():
    reg = _registry()
    fn = _scaled()
    assert [_run(reg, fn, (i,)) for i in range(3)] == [0, 2, 4]
    cache = reg.function_cache
    assert (cache.pickled, cache.hits) == (1, 2)
    fresh, _, _ = reg.dumps(fn)
    assert cache._entries[fn.__code__].blob == fresh
    _run(reg, _scaled(), (1,))                    # a new function object with the same code and values: a hit
    assert (cache.pickled, cache.hits) == (1, 3)


def _with_helper():
    def helper(x):
        return x + HELPER_OFFSET

    def fn(x):
        return helper(x) * 10
    return fn


@pytest.mark.parametrize("make_fn, name, value, arg, before, after", [
    (_scaled, "SCALE", 3, 5, 10, 15),                 # a global of the function itself
    (_with_helper, "HELPER_OFFSET", 1, 1, 10, 20),    # a global of a helper function it calls
], ids=["own_global", "helper_global"])
def test_rebound_global_is_pickled_again_and_seen(monkeypatch, make_fn, name, value, arg, before, after):
    reg = _registry()
    fn = make_fn()
    assert _run(reg, fn, (arg,)) == before
    monkeypatch.setitem(globals(), name, value)
    assert _run(reg, fn, (arg,)) == after
    assert reg.function_cache.pickled == 2


def test_list_mutated_in_place_is_not_cached_and_is_seen():
    def total():
        return sum(ITEMS)

    reg = _registry()
    assert _run(reg, total) == 3
    ITEMS.append(10)
    try:
        assert _run(reg, total) == 13
    finally:
        ITEMS.pop()
    assert reg.function_cache.pickled == 0 and reg.function_cache.hits == 0


def test_rebound_closure_cell_is_seen():
    reg = _registry()
    factor = 2

    def fn(x):
        return x * factor

    assert _run(reg, fn, (4,)) == 8
    factor = 5
    assert _run(reg, fn, (4,)) == 20
    assert reg.function_cache.pickled == 2


def test_which_closure_cells_are_shared_is_part_of_the_fingerprint():
    def make():
        x = 1

        def g():
            return x

        def top():
            return g() + x
        return top

    top = make()
    cells = {name: cell for name, cell in zip(top.__code__.co_freevars, top.__closure__)}
    own = types.FunctionType(top.__code__, top.__globals__, closure=tuple(
        types.CellType(1) if name == "x" else cells[name] for name in top.__code__.co_freevars))
    reg = _registry()
    assert _run(reg, top) == _run(reg, own) == 2
    assert reg.function_cache.pickled == 2   # same code and values, but top shares its cell x with g
    assert reg.function_cache._entries[own.__code__].blob == reg.dumps(own)[0]


def test_nonlocal_counter_on_the_worker_starts_from_the_chief_value_each_closure():
    reg = _registry()
    count = 0

    def bump():
        nonlocal count
        count += 1
        return count

    assert [_run(reg, bump) for _ in range(3)] == [1, 1, 1]
    assert reg.function_cache.hits == 2


def test_mutable_default_unregistered_module_and_dynamic_class_are_not_cached():
    class Local:
        pass

    plain = torch.nn.Linear(2, 2)
    tensor = torch.zeros(2)

    def default(x, acc=[]):  # noqa: B006 - the point of the test
        return len(acc)

    def module_fn():
        return plain.weight.shape

    def tensor_fn():
        return tensor.sum()

    def class_fn():
        return Local

    reg = _registry()
    for fn in (default, module_fn, tensor_fn, class_fn):
        assert reg.function_cache.fingerprint(fn) is None, fn
    assert _run(reg, default, (0,)) == 0
    tensor.add_(1)
    assert float(_run(reg, tensor_fn)) == 2.0          # the change made in place travels
    assert reg.function_cache.pickled == 0


def test_partial_bound_method_and_callable_object_are_pickled_every_time():
    class Step:
        def __call__(self, x):
            return x + 1

        def method(self, x):
            return x + 2

    reg = _registry()
    for fn, want in ((functools.partial(lambda a, b: a * b, 3), 6), (Step().method, 4), (Step(), 3)):
        assert reg.function_cache.fingerprint(fn) is None
        assert _run(reg, fn, (2,)) == want
    assert reg.function_cache.pickled == 0


def test_a_function_in_the_arguments_is_pickled_with_the_function():
    def apply(g, x):
        return g(x), g is helper

    def helper(x):
        return -x

    reg = _registry()
    assert _run(reg, apply, (helper, 3)) == (-3, True)     # one helper on the worker, as without the cache
    blob, _, _ = reg.dumps_closure(apply, (helper, 3), {})
    assert blob == reg.dumps((apply, (helper, 3), {}))[0]     # the uncached pickle, in one piece


def test_tf_style_strategy_run_wrapper_is_cached_and_runs_its_replica_function():
    reg = _registry()
    strategy = reg.strategy                     # sent by reference: a worker's one-replica view

    def replica_fn(x):
        return x * SCALE

    def step(x):
        return strategy.run(replica_fn, args=(x,))

    assert [_run(reg, step, (i,)) for i in (1, 2)] == [2, 4]
    assert (reg.function_cache.pickled, reg.function_cache.hits) == (1, 1)


def test_registered_module_and_optimizer_are_references_and_cacheable():
    reg = _registry()
    model = torch.nn.Linear(3, 2)
    for name, p in model.named_parameters():
        reg.track_scope_param(model, name, p)
    reg.place_pending()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    x = torch.ones(1, 3)
    reg.dumps_closure(step, (x,), {})          # registers the module and the optimizer (as before)
    _, refs, _ = reg.dumps_closure(step, (x,), {})
    _, refs2, _ = reg.dumps_closure(step, (x,), {})
    assert reg.function_cache.pickled == 1 and reg.function_cache.hits == 1
    kinds = {k for k, _ in refs}
    assert {"module", "optimizer"} <= kinds and refs2 == refs


# ---- a real cluster ------------------------------------------------------------------------------------
LR = 0.1
TARGETS = [1.0, 2.0]


def _train(coordinator, strategy, use_cache):
    reg = strategy._registry
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    saved = reg.function_cache.fingerprint
    if not use_cache:
        reg.function_cache.fingerprint = lambda fn: None   # type: ignore[method-assign]
    try:
        for x, y in batches:
            coordinator.schedule(step, args=(x, y))
            coordinator.join()
    finally:
        reg.function_cache.fingerprint = saved             # type: ignore[method-assign]
    return [p.detach().clone() for p in model.parameters()]


def _chief_body(strategy):
    global LR
    coordinator = ts.coordinator.ClusterCoordinator(strategy)
    cache = strategy._registry.function_cache
    out = {}

    def read_lr():
        return LR

    def read_targets():
        return list(TARGETS)

    seen = [coordinator.schedule(read_lr).fetch(), coordinator.schedule(read_lr).fetch()]
    LR = 0.5
    seen.append(coordinator.schedule(read_lr).fetch())
    LR = 0.1
    out["lr"] = seen
    out["lr_pickled"] = cache.pickled
    first = coordinator.schedule(read_targets).fetch()
    TARGETS.append(3.0)
    out["targets"] = [first, coordinator.schedule(read_targets).fetch()]

    shift = 1

    def shifted():
        return shift

    before = coordinator.schedule(shifted).fetch()
    shift = 7
    out["cell"] = [before, coordinator.schedule(shifted).fetch()]

    hits = cache.hits
    cached = _train(coordinator, strategy, use_cache=True)
    out["train_hits"] = cache.hits - hits
    uncached = _train(coordinator, strategy, use_cache=False)
    out["train_equal"] = all(torch.equal(a, b) for a, b in zip(cached, uncached))
    torch.manual_seed(0)
    out["trained"] = not torch.equal(cached[0], torch.nn.Linear(4, 1).weight)
    return out


def _cluster(rank, world_size):
    return serve_or_train(ts.cluster_resolver.TorchrunClusterResolver(num_ps=1), _chief_body, timeout=30)


@pytest.mark.timeout(200)
def test_cluster_sees_rebound_and_mutated_state_and_cached_training_equals_uncached():
    results = run_ranks(_cluster, 3, init_process_group=False, timeout=150)
    assert results[1:] == ["ps", "worker"]
    out = results[0]
    assert out["lr"] == [0.1, 0.1, 0.5]
    assert out["lr_pickled"] == 2                 # once for LR=0.1 (twice scheduled), once for LR=0.5
    assert out["targets"] == [[1.0, 2.0], [1.0, 2.0, 3.0]]
    assert out["cell"] == [1, 7]
    assert out["train_hits"] >= 4                 # the first schedule registers the model; then hits
    assert out["train_equal"] and out["trained"]
