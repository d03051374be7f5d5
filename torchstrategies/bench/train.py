"""Training throughput of data-parallel strategies: ``torchstrategies bench train --nproc 2``.

One torchrun job (launched here) trains the MLP 784-1024-1024-10 on synthetic data, batch 64 per rank,
with every requested runner in turn, interleaved over several rounds (medians reported), so all rows come
from the same run on the same machine state:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on gloo (the baseline);
* ``ddp-torchstrategies``: the same DDP on a process group of the ``"torchstrategies"`` backend
  (``dist.new_group(backend="torchstrategies")``, AUTO: shared memory on one host);
* ``mwms-<IMPL>``: MultiWorkerMirroredStrategy with ``CommunicationOptions(implementation=IMPL)``
  (``mwms-default`` is ``MultiWorkerMirroredStrategy()`` as a user gets it);
* ``mwms-no-agreement`` (not a default row): ``mwms-default`` with the per-step agreement check off
  (``TORCHSTRATEGIES_AGREEMENT=0``), to measure the check's cost beside ``mwms-default``;
* ``no-comm``: our strategy with a comm hook that hands each gradient bucket back as it is: the same work
  (buckets, hooks, the step) without communication, the ceiling for any synchronous strategy. (Not
  ``no_sync()``: under the gradient rule the optimizer step reduces what ``no_sync`` left unreduced.)

Other strategies add a row with :func:`register_runner` in a module listed in :data:`RUNNER_MODULES`.

Example:
    >>> from torchstrategies.bench import train
    >>> result = train.run(nproc=2, steps=50, progress=False)          # doctest: +SKIP
    >>> result.print()                                                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchstrategies.bench.launch import environment, job_env, run_job, worker_spec
from torchstrategies.bench.mlp import SIZES, mlp
from torchstrategies.bench.report import BenchResult, bar_chart, median
from torchstrategies.bench.tf_baseline import ENV_VAR as ENV_TF_PYTHON

__all__ = ["run", "plot", "register_runner", "RUNNERS", "RUNNER_MODULES", "BenchContext"]

# Modules imported by the worker before it looks up runners; each may call register_runner(...).
RUNNER_MODULES: list[str] = ["torchstrategies.bench.keras_fit",   # keras-mwms, keras-one-process (not default rows)
                              "torchstrategies.bench.fault_tolerance"]   # ft-GLOO, ft-AUTO (not default rows)


@dataclass
class BenchContext:
    """What a runner gets: rank, world size, per-rank batch size and a seed."""

    rank: int
    world_size: int
    batch: int
    seed: int = 0


Runner = Callable[[BenchContext], tuple[Callable[[], None], Callable[[], None]]]
RUNNERS: dict[str, Runner] = {}
DEFAULT_ORDER: list[str] = []


def register_runner(name: str, setup: Runner, default: bool = True) -> None:
    """Adds a row: ``setup(ctx) -> (step, teardown)``; ``step()`` runs one training step on this rank.

    Every rank runs the same runners in the same order; ``step`` may communicate.
    """
    RUNNERS[name] = setup
    if default and name not in DEFAULT_ORDER:
        DEFAULT_ORDER.append(name)


def _data(ctx: BenchContext) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(ctx.seed + ctx.rank)
    return torch.randn(ctx.batch, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (ctx.batch,), generator=g)


def _ddp(backend: str) -> Runner:
    def setup(ctx: BenchContext) -> tuple[Callable[[], None], Callable[[], None]]:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import torchstrategies  # noqa: F401 - registers the "torchstrategies" backend

        group = None if backend == "gloo" else dist.new_group(backend=backend)
        torch.manual_seed(ctx.seed)
        model = DDP(mlp(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = _data(ctx)

        def step() -> None:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        def teardown() -> None:
            if group is not None:
                dist.destroy_process_group(group)

        return step, teardown

    return setup


def _mwms(implementation: str | None, no_comm: bool = False, env: dict[str, str] | None = None,
          bytes_per_pack: int | None = None) -> Runner:
    def setup(ctx: BenchContext) -> tuple[Callable[[], None], Callable[[], None]]:

        import torch

        from torchstrategies import CommunicationOptions
        from torchstrategies.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy

        options = None if implementation is None else CommunicationOptions(implementation=implementation)
        if bytes_per_pack is not None:
            options = CommunicationOptions(bytes_per_pack=bytes_per_pack)
        with environment(env or {}):  # the variables only tune this runner's strategy, not the rows after it
            strategy = MultiWorkerMirroredStrategy(communication_options=options)
        with strategy.scope():
            torch.manual_seed(ctx.seed)
            model = mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if no_comm:
            strategy.extended.register_comm_hook(_no_communication)
        x, y = _data(ctx)
        global_batch = ctx.batch * ctx.world_size

        def step() -> None:
            per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            (per_example.sum() / global_batch).backward()
            opt.step()
            opt.zero_grad()

        return step, strategy.shutdown

    return setup


def _no_communication(group: Any, bucket: Any) -> Any:
    """A comm hook that reduces nothing: the bucket's own contents, at once."""
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _implementations() -> list[str]:
    from torchstrategies import CommunicationImplementation

    return [i.name for i in CommunicationImplementation if i.name not in ("NCCL", "AUTO", "TREE")]


register_runner("ddp", _ddp("gloo"))
register_runner("ddp-torchstrategies", _ddp("torchstrategies"))
register_runner("mwms-default", _mwms(None))
for _impl in _implementations():
    register_runner(f"mwms-{_impl}", _mwms(_impl), default=False)
# The no-communication rate: gradients are not reduced, so the ranks' models drift apart by design; the
# per-step agreement check, which would name that at once, is off for this row (TORCHSTRATEGIES_AGREEMENT=0).
register_runner("no-comm", _mwms(None, no_comm=True, env={"TORCHSTRATEGIES_AGREEMENT": "0"}))
# Gradient bucket sizes (CommunicationOptions.bytes_per_pack; the default, 0, is one bucket): which one a slow
# link between hosts wants (bench train --hosts).
PACK_MIB = (1, 4, 16)
for _mib in PACK_MIB:
    register_runner(f"mwms-pack-{_mib}MiB", _mwms(None, bytes_per_pack=_mib << 20), default=False)
# mwms-default with the per-step agreement check off (TORCHSTRATEGIES_AGREEMENT=0, the benchmarking knob of
# distribute/agreement.py): beside mwms-default in the same run it shows what the check costs
# (`torchstrategies bench train --strategy mwms-default --strategy mwms-no-agreement`).
register_runner("mwms-no-agreement", _mwms(None, env={"TORCHSTRATEGIES_AGREEMENT": "0"}), default=False)

# --- the torchrun worker ------------------------------------------------------------------------------------
def _worker(args: dict[str, Any], out: str) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from torchstrategies.strategies._mw_cluster import import_dynamo_first

    for mod in RUNNER_MODULES + list(args.get("modules", [])):
        importlib.import_module(mod)
    import_dynamo_first()   # before the group: else its gloo threads may abort the exit (_mw_cluster.py)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = BenchContext(rank, world, args["batch"])
    names, rounds = args["runners"], args["rounds"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i, name in enumerate(names):
            times[name].append(_time_runner(RUNNERS[name](ctx), args["steps"], args["warmup"]))
            if rank == 0:
                print(f"PROGRESS {r * len(names) + i + 1} {rounds * len(names)} {name}", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times}, f)
    dist.destroy_process_group()


def _time_runner(runner: tuple[Callable[[], None], Callable[[], None]], steps: int, warmup: int) -> float:
    """Seconds for ``steps`` steps after ``warmup``, the slowest rank's (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    step, teardown = runner
    for _ in range(warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    teardown()
    return float(dt.item())


def _ratios(row: dict[str, Any], base: float | None, ceiling: float | None) -> dict[str, Any]:
    """``row`` with its samples/s over ddp's and as a percentage of no-comm's (blank where either is absent)."""
    rate = row["samples/s"]
    numeric = isinstance(rate, (int, float))
    row["vs ddp"] = rate / base if base and numeric else ""
    row["% of no-comm"] = 100.0 * (rate / ceiling) if ceiling and numeric else ""
    return row


def run(nproc: int = 2, strategies: list[str] | None = None, steps: int = 100, warmup: int = 10, rounds: int = 3,
        batch: int = 64, progress: bool = True, modules: list[str] | None = None,
        parameter_server: bool = False, in_process: bool = True, tf_python: str | None = None,
        tf_inter_op: int | None = None, hosts: int = 0, link: str | int = "1gbit") -> BenchResult:
    """Launches torchrun with ``nproc`` ranks and measures samples/s of each runner; with ``hosts``, runs the
    ranks across that many network namespaces on rate-limited links instead (as root; ``bench/netns.py``).

    Args:
        nproc: ranks (processes) on this host.
        strategies: runner names (default: ddp, ddp-torchstrategies, mwms-default, every mwms-<IMPL>, no-comm).
        steps / warmup / rounds: timed steps per measurement, untimed steps before it, interleaved rounds.
        batch: per-rank batch size.
        progress: show a progress bar (stderr).
        modules: extra modules to import in the workers (they may register runners).
        parameter_server: also run ``bench/train_ps.py`` (its own torchrun job: chief, 1 ps and ``nproc``
            workers) and append its row (its samples/s come from a different launch: compare loosely).
        in_process: also append the in-process rows of ``bench/train_inproc.py`` (strategy overhead per
            replica on a small MLP; MirroredStrategy(2) eager and torch.compile-d on the MLP), measured in
            this process after the torchrun job.
        tf_python: a Python that has TensorFlow (None: the environment variable TORCHSTRATEGIES_TF_PYTHON,
            if set and ``in_process``): adds TF's MirroredStrategy(2) and OneDeviceStrategy rows to the
            in-process compile rows and the column 'vs TF Mirrored(2)' (``bench/tf_baseline.py``). Needs
            ``in_process``.
        tf_inter_op: TF inter-op threads for those rows (default: one per replica).
        hosts: 2 or more: ``nproc / hosts`` ranks in each of ``hosts`` network namespaces, each with a link of
            rate ``link`` ("1gbit"); the in-process rows are left out (they use no link). Rows worth running
            there: ddp, ddp-torchstrategies, mwms-default, mwms-pack-<1|4|16>MiB, no-comm.
        link: see ``hosts``.
    """
    if hosts:
        if parameter_server:
            raise ValueError("parameter_server rows are not run across hosts; leave parameter_server False")
        in_process = False
    if tf_python is None and in_process:
        tf_python = os.environ.get(ENV_TF_PYTHON) or None
    if tf_python is not None and not in_process:
        raise ValueError(f"tf_python={tf_python!r} adds in-process rows; it needs in_process=True")
    names = _runner_names(strategies, modules)
    env = job_env()
    load0 = os.getloadavg()
    spec = {"runners": names, "steps": steps, "warmup": warmup, "rounds": rounds, "batch": batch,
            "modules": list(modules or [])}
    if hosts:
        from torchstrategies.bench.hosts_launch import run_job_across_hosts
        from torchstrategies.bench.netns import parse_rate

        rate_bits = parse_rate(link)
        times = run_job_across_hosts("torchstrategies.bench.train", hosts, nproc, ["--spec", json.dumps(spec)],
                                     rate_bits, total=rounds * len(names), desc=f"bench train across {hosts} hosts",
                                     progress=progress, timeout=3600.0)["times"]
    else:
        times = run_job("torchstrategies.bench.train", nproc, ["--spec", json.dumps(spec)], env,
                        total=rounds * len(names), desc="bench train", progress=progress)["times"]
    rate = {n: nproc * batch * steps / median(times[n]) for n in names}
    base, ceiling = rate.get("ddp"), rate.get("no-comm")
    rows = [_ratios({"runner": n, "samples/s": rate[n], "ms/step": 1e3 * median(times[n]) / steps}, base, ceiling)
            for n in names]
    import torch

    result = BenchResult(
        title=f"Training throughput, MLP {'-'.join(map(str, SIZES))}, batch {batch}/rank, {nproc} ranks"
        + (f" across {hosts} hosts on {link} links (network namespaces)" if hosts else ""),
        columns=["runner", "samples/s", "ms/step", "vs ddp", "% of no-comm"],
        rows=rows,
        notes=[f"median of {rounds} interleaved rounds of {steps} steps after {warmup} warm-up steps; "
               f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; "
               f"load average before/after: {load0[0]:.1f}/{os.getloadavg()[0]:.1f} (other processes share "
               "the cores: compare rows of one run, not runs)"],
        meta={"nproc": nproc, "steps": steps, "rounds": rounds, "batch": batch, "times": times, "hosts": hosts,
              "link": link if hosts else None},
    )
    if parameter_server:
        _append_ps_row(result, nproc, steps, warmup, rounds, batch, progress, base, ceiling)
    if in_process:
        from torchstrategies.bench import train_inproc

        _append(result, train_inproc.run(steps=steps, warmup=warmup, rounds=rounds,
                                         threads=int(env["OMP_NUM_THREADS"]), tf_python=tf_python,
                                         tf_inter_op=tf_inter_op))
    return result


def _append(result: BenchResult, inproc: BenchResult) -> None:
    """Appends the in-process rows (``bench inproc``) to the torchrun rows, with their extra columns."""
    result.columns += [c for c in inproc.columns if c not in result.columns]
    result.rows = [{c: r.get(c, "") for c in result.columns} for r in result.rows + inproc.rows]
    result.notes += ["in-process rows: measured in this process after the torchrun job, with "
                     "OMP_NUM_THREADS torch thread(s)", *inproc.notes]


def _runner_names(strategies: list[str] | None, modules: list[str] | None) -> list[str]:
    """The runners to time: ``strategies``, or every default one (after importing ``modules``).

    Raises:
        ValueError: an unknown runner (the message lists the known ones).
    """
    for m in RUNNER_MODULES + list(modules or []):
        __import__(m)
    names = list(strategies) if strategies else (
        ["ddp", "ddp-torchstrategies", "mwms-default"] + [f"mwms-{i}" for i in _implementations()] + ["no-comm"])
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown runner(s) {unknown}; known: {sorted(RUNNERS)}")
    return names


def _append_ps_row(result: BenchResult, nproc: int, steps: int, warmup: int, rounds: int, batch: int,
                   progress: bool, base: float | None, ceiling: float | None) -> None:
    """Runs ``bench train-ps`` with ``nproc`` workers (chief, 1 ps) and appends its ps-async row."""
    from torchstrategies.bench import train_ps

    ps = train_ps.run(nproc=nproc + 2, num_ps=1, steps=steps, warmup=warmup, rounds=rounds, batch=batch,
                      progress=progress)
    for row in train_ps.rows_for_train_table(ps):
        result.rows.append(_ratios({c: row.get(c, "") for c in ("runner", "samples/s", "ms/step")}, base, ceiling))
    result.notes.append(f"ParameterServer row: a separate torchrun job of {nproc + 2} processes "
                        f"(chief, 1 ps, {nproc} workers), asynchronous training")


def plot(result: BenchResult, path: str) -> None:
    """Bar chart of samples/s per runner."""
    bar_chart(result, path, "samples/s", references=("ddp", "no-comm"))


if __name__ == "__main__":  # the torchrun worker that run() launches
    # Through the imported module, not this __main__ copy: runner modules register into that one's RUNNERS.
    from torchstrategies.bench import train as _train

    _train._worker(*worker_spec())
