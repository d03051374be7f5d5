"""In-process training rows of ``torchstrategies bench train``: strategy overhead and torch.compile.

Two groups, measured in the calling process (one intra-op thread unless OMP_NUM_THREADS says otherwise),
interleaved over ``rounds`` (medians):

* overhead: the MLP 64-64-10, global batch 32, SGD, ``zero_grad`` / forward / backward / step, under
  OneDeviceStrategy and MirroredStrategy with 1, 2 and 3 replicas, and as plain torch doing the same work:
  the global batch in N slices (one forward/backward per slice, gradients accumulated, one step; N = 1 is
  the ordinary full-batch step), loss ``sum / global batch`` as ``compute_average_loss`` computes it. The
  ``overhead us/replica`` column is ``(step time - plain torch N-slice step time) / N`` for N replicas:
  the strategy's own cost. ``above 1-pass torch us/replica`` is ``(step time - full-batch torch step) /
  N``, which also counts the extra forward/backward passes N replicas make on N smaller batches. The row
  ``Mirrored(2), no agreement`` is Mirrored(2) with the per-step agreement check's rotating slice off
  (``TORCHSTRATEGIES_AGREEMENT=0``, the benchmarking knob): beside ``Mirrored(2)`` it shows what the check
  costs (the comparison of what replicas wrote, which names a wrong result, stays on).
* compile: the MLP 784-1024-1024-10, global batch 64, as plain torch (full batch, and the same two
  half-batch passes as two replicas make: ``2 slices``) and MirroredStrategy(2) on CPU, eager and
  ``torch.compile``-d (the model compiled inside the scope). ``x torch same passes`` is a Mirrored(2)
  row's step time over plain torch's 2-slice step time (eager over eager, compiled over compiled). ``2 own
  copies`` is plain torch doing by hand what two replicas that each own a copy of the model must do (a pass
  per copy, the gradient sum handed to both, the update copied): the floor of that design. With
  ``tf_python`` (a Python that has TensorFlow) the group also times TensorFlow's MirroredStrategy(2) and
  OneDeviceStrategy on the same model (``tf_mirrored.py`` in a subprocess, one round of it after each torch
  round, on as many threads as torch) and adds the column ``vs TF Mirrored(2)``: a row's steps/s over TF
  MirroredStrategy(2)'s, both from this run.

``torchstrategies bench inproc`` runs them alone; ``bench train`` appends them to its table.

Example:
    >>> from torchstrategies.bench import train_inproc
    >>> r = train_inproc.run(steps=5, warmup=2, rounds=1, groups=("overhead",))   # doctest: +SKIP
    >>> r.print()                                                                    # doctest: +SKIP
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torchstrategies.bench.launch import environment
from torchstrategies.bench.mlp import SIZES as COMPILE_SIZES
from torchstrategies.bench.mlp import mlp as _mlp
from torchstrategies.bench.report import BenchResult, median
from torchstrategies.bench.tf_baseline import ENV_VAR as ENV_TF_PYTHON

if TYPE_CHECKING:
    import torch

    from torchstrategies.bench.tf_baseline import TFBaseline
    from torchstrategies.distribute.distribute_lib import Strategy

__all__ = ["run", "OVERHEAD_SIZES", "COMPILE_SIZES", "TF_COLUMN", "SAME_PASSES_COLUMN", "COLUMNS"]

OVERHEAD_SIZES = (64, 64, 10)
COMPILE_BATCH = 64
LR = 0.01
TF_COLUMN = "vs TF Mirrored(2)"
SAME_PASSES_COLUMN = "x torch same passes"
COLUMNS = ["runner", "samples/s", "ms/step", "steps/s", "overhead us/replica", "above 1-pass torch us/replica",
           SAME_PASSES_COLUMN]


def _setup(kind: str, replicas: int, sizes: Sequence[int], batch: int, compiled: bool) -> Callable[[], None]:
    """One training step of ``kind`` ("torch", "torch-copies", "one_device", "mirrored", "mirrored-no-agreement":
    Mirrored with the per-step agreement check's rotating slice off) as a no-argument function."""
    import torch

    import torchstrategies as ts

    torch.manual_seed(0)
    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))
    if kind == "torch":
        model = _mlp(sizes)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        fwd = torch.compile(model) if compiled else model
        if replicas == 1:

            def plain() -> None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(fwd(x), y, reduction="none").sum().div(batch).backward()
                opt.step()

            return plain
        slices = list(zip(x.chunk(replicas), y.chunk(replicas), strict=True))

        def sliced() -> None:  # what N replicas compute, in one thread: N passes, one step
            opt.zero_grad()
            for xb, yb in slices:
                torch.nn.functional.cross_entropy(fwd(xb), yb, reduction="none").sum().div(batch).backward()
            opt.step()

        return sliced
    if kind == "torch-copies":
        return _own_copies(sizes, replicas, x, y, batch, compiled)
    strategy = _strategy(kind, replicas)
    with strategy.scope():
        model = _mlp(sizes)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        fwd = torch.compile(model) if compiled else model
    n = strategy.num_replicas_in_sync
    def split(t: torch.Tensor) -> object:
        return strategy.experimental_distribute_values_from_function(
            lambda c: t.chunk(n)[c.replica_id_in_sync_group]
        )

    xs, ys = split(x), split(y)

    def replica_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        per_example = torch.nn.functional.cross_entropy(fwd(xb), yb, reduction="none")
        ts.compute_average_loss(per_example, global_batch_size=batch).backward()
        opt.step()

    def step() -> None:
        strategy.run(replica_step, args=(xs, ys))

    return step


def _own_copies(sizes: Sequence[int], replicas: int, x: torch.Tensor, y: torch.Tensor, batch: int,
                compiled: bool) -> Callable[[], None]:
    """Plain torch doing by hand what replicas that own their copy of the model must do, in one thread: a
    pass per slice on its own copy, the gradients summed into copy 0's and the sum copied into every other
    copy's gradient (each replica holds the global gradient), one step, the update copied into every
    other copy. The floor of any engine of that design (what Mirrored(N) adds above it is its own)."""
    import copy

    import torch

    models = [_mlp(sizes)]
    models += [copy.deepcopy(models[0]) for _ in range(replicas - 1)]
    opt = torch.optim.SGD(models[0].parameters(), lr=LR)
    fwds = [torch.compile(m) if compiled else m for m in models]
    params: list[list[torch.Tensor]] = [list(m.parameters()) for m in models]
    slices = list(zip(x.chunk(replicas), y.chunk(replicas), strict=True))

    def grads(ps: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.grad for p in ps if p.grad is not None]

    def step() -> None:
        for m in models:
            m.zero_grad()
        for fwd, (xb, yb) in zip(fwds, slices, strict=True):
            torch.nn.functional.cross_entropy(fwd(xb), yb, reduction="none").sum().div(batch).backward()
        with torch.no_grad():
            first = grads(params[0])
            for ps in params[1:]:
                torch._foreach_add_(first, grads(ps))
            for ps in params[1:]:
                torch._foreach_copy_(grads(ps), first)
        opt.step()
        with torch.no_grad():
            for ps in params[1:]:
                torch._foreach_copy_(ps, params[0])

    return step


def _strategy(kind: str, replicas: int) -> Strategy:
    """The strategy of a ``kind`` of :func:`_setup` ("one_device", "mirrored", "mirrored-no-agreement")."""
    import torchstrategies as ts
    from torchstrategies.distribute import agreement

    if kind == "one_device":
        return ts.OneDeviceStrategy("cpu")
    if kind == "mirrored":
        return ts.MirroredStrategy(num_replicas=replicas)
    with environment({agreement.ENV: "0"}):   # the benchmarking knob, read when the strategy is made
        return ts.MirroredStrategy(num_replicas=replicas)


def _time(step: Callable[[], None], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def run(
    steps: int = 200,
    warmup: int = 20,
    rounds: int = 3,
    groups: Sequence[str] = ("overhead", "compile"),
    threads: int | None = None,
    tf_python: str | None = None,
    tf_inter_op: int | None = None,
) -> BenchResult:
    """Measures the in-process rows (``torchstrategies bench inproc``; ``bench train`` appends them).

    Args:
        steps / warmup / rounds: timed steps (the compile group times ``steps // 10``), untimed steps and
            interleaved rounds.
        groups: "overhead" and/or "compile".
        threads: torch intra-op threads for the measurement (restored afterwards); None keeps the current.
            TF computes on as many threads (``TFBaseline``: inter-op x intra-op).
        tf_python: a Python executable with TensorFlow: adds TF's rows to the compile group (None: no TF).
        tf_inter_op: TF inter-op threads; None gives ``min(threads, 2)`` (``TFBaseline``'s default).

    Returns:
        A BenchResult with :data:`COLUMNS` (and :data:`TF_COLUMN` with ``tf_python``), one row per case.

    Raises:
        ValueError: ``tf_python`` without the compile group.
        TFBaselineError: the TF process failed (the message names the Python and shows its stderr).
    """
    import torch

    if tf_python is not None and "compile" not in groups:
        raise ValueError(f"tf_python={tf_python!r} adds rows to the compile group, which groups={groups!r} lacks")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used = torch.get_num_threads()
        if tf_python is None:
            out = _rows(steps, warmup, rounds, groups, None)
        else:
            from torchstrategies.bench.tf_baseline import TFBaseline

            with TFBaseline(tf_python, replicas=2, threads=used, inter_op=tf_inter_op, sizes=COMPILE_SIZES,
                            batch=COMPILE_BATCH, lr=LR) as tf:
                out = _rows(steps, warmup, rounds, groups, tf)
    finally:
        torch.set_num_threads(before)
    notes = [f"median of {rounds} interleaved rounds; {used} torch thread(s); overhead rows: MLP 64-64-10, "
             "global batch 32, overhead = '(step - plain torch step on the same N batch slices) / N replicas'; "
             f"compiled rows: MLP {'-'.join(map(str, COMPILE_SIZES))}, global batch {COMPILE_BATCH}, model "
             "compiled in scope"]
    notes += [r.pop("note") for r in out if "note" in r]
    if tf_python is None and "compile" in groups:
        notes.append("TF 2.21 baseline rows (MirroredStrategy(2), OneDeviceStrategy) are left out: add "
                     f"them with --tf-python PATH or {ENV_TF_PYTHON}=PATH, a Python that has TensorFlow")
    columns = COLUMNS + ([TF_COLUMN] if tf_python is not None else [])
    return BenchResult(f"In-process training steps, {used} torch thread(s)", columns,
                       [{c: r.get(c, "") for c in columns} for r in out], notes,
                       {"steps": steps, "warmup": warmup, "rounds": rounds, "groups": list(groups)})


Case = tuple[str, str, str, int, Sequence[int], int, bool]


def _rows(steps: int, warmup: int, rounds: int, groups: Sequence[str], tf: TFBaseline | None) -> list[dict[str, Any]]:
    cases: list[Case] = []
    s: Sequence[int]
    if "overhead" in groups:
        s = OVERHEAD_SIZES
        cases += [
            ("overhead", "in-process overhead: torch", "torch", 1, s, 32, False),
            ("overhead", "in-process overhead: torch, 2 slices", "torch", 2, s, 32, False),
            ("overhead", "in-process overhead: torch, 3 slices", "torch", 3, s, 32, False),
            ("overhead", "in-process overhead: OneDevice", "one_device", 1, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(1)", "mirrored", 1, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(2)", "mirrored", 2, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(2), no agreement", "mirrored-no-agreement", 2, s, 32, False),
            ("overhead", "in-process overhead: Mirrored(3)", "mirrored", 3, s, 32, False),
        ]
    if "compile" in groups:
        s, b = COMPILE_SIZES, COMPILE_BATCH
        cases += [
            ("compile", "in-process torch eager", "torch", 1, s, b, False),
            ("compile", "in-process torch compiled", "torch", 1, s, b, True),
            ("compile", "in-process torch eager, 2 slices", "torch", 2, s, b, False),
            ("compile", "in-process torch compiled, 2 slices", "torch", 2, s, b, True),
            ("compile", "in-process torch eager, 2 own copies", "torch-copies", 2, s, b, False),
            ("compile", "in-process Mirrored(2) eager", "mirrored", 2, s, b, False),
            ("compile", "in-process Mirrored(2) compiled", "mirrored", 2, s, b, True),
        ]
    tf_cases: list[Case] = []
    if tf is not None:
        version = tf.info.get("tf", "?")
        tf_cases = [
            ("compile", f"TF {version} MirroredStrategy(2)", "tf:mirrored", 2, COMPILE_SIZES, COMPILE_BATCH, True),
            ("compile", f"TF {version} OneDeviceStrategy", "tf:one_device", 1, COMPILE_SIZES, COMPILE_BATCH, True),
        ]
    steps_of = {"overhead": steps, "compile": max(1, steps // 10)}
    warmup_of = {"overhead": warmup, "compile": 3}
    timers: dict[str, Callable[[int, int], float]] = {
        c[1]: functools.partial(_time, _setup(c[2], c[3], c[4], c[5], c[6])) for c in cases
    }
    for c in tf_cases:
        assert tf is not None
        timers[c[1]] = functools.partial(tf.seconds_per_step, c[2].split(":", 1)[1])
    cases += tf_cases
    times: dict[str, list[float]] = {c[1]: [] for c in cases}
    for _ in range(rounds):
        for c in cases:
            times[c[1]].append(timers[c[1]](steps_of[c[0]], warmup_of[c[0]]))
    plain = {  # plain torch doing the work of N replicas
        c[3]: median(times[c[1]]) for c in cases if c[0] == "overhead" and c[2] == "torch"
    }
    same_passes = {  # plain torch doing Mirrored(2)'s two half-batch passes, eager and compiled
        c[6]: median(times[c[1]]) for c in cases if c[0] == "compile" and c[2] == "torch" and c[3] == 2
    }
    tf_mirrored = median(times[tf_cases[0][1]]) if tf_cases else None
    out = []
    for group, name, kind, replicas, _sizes, batch, _compiled in cases:
        t = median(times[name])
        row: dict[str, Any] = {"runner": name, "samples/s": batch / t, "ms/step": 1e3 * t, "steps/s": 1.0 / t}
        if group == "overhead" and kind != "torch":
            row["overhead us/replica"] = 1e6 * (t - plain[replicas]) / replicas
            row["above 1-pass torch us/replica"] = 1e6 * (t - plain[1]) / replicas
        if group == "compile" and kind in ("mirrored", "torch-copies"):
            row[SAME_PASSES_COLUMN] = t / same_passes[_compiled]
        if group == "compile" and tf_mirrored is not None:
            row[TF_COLUMN] = tf_mirrored / t
        if kind == "tf:mirrored" and tf is not None:
            row["note"] = _tf_note(tf.info)
        out.append(row)
    return out


def _tf_note(info: dict[str, Any]) -> str:
    return (
        f"TF rows: TensorFlow {info.get('tf')} in its own process (bench/tf_mirrored.py), MirroredStrategy "
        f"over logical CPU devices {info.get('devices')} and OneDeviceStrategy, a tf.function step "
        "(strategy.run: forward, compute_average_loss, gradient, all_reduce SUM, merge_call update; "
        f"no Keras), intra-op threads {info.get('intra_op')}, inter-op {info.get('inter_op')}; one TF round "
        f"after each torch round; '{TF_COLUMN}' = TF MirroredStrategy(2) step time / the row's step time"
    )
