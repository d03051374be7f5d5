"""``torchstrategies bench kernels | allreduce | train | train-ps | inproc | ft-recovery | agreement``: the
options and help of each benchmark command. Each runs ``torchstrategies.cli.bench_cmds.<command>`` (imported
when it runs), which calls ``torchstrategies.bench.<name>.run(...)`` and reports its result."""

from __future__ import annotations

from collections.abc import Callable

import click

from torchstrategies_cli._command import ImplCommand
from torchstrategies_cli._options import (
    count_option,
    nproc_option,
    output_options,
    repeats_option,
    sizes_option,
)

__all__ = ["bench"]

IMPL = "torchstrategies.cli.bench_cmds:"


@click.group()
def bench() -> None:
    """Benchmarks: kernels, all-reduce implementations, training throughput."""


@bench.command(cls=ImplCommand, target=IMPL + "kernels")
@count_option("--n", "n", "Number of tensors summed (repeat: --n 2 --n 8). Default: the module's (2, 4, 8, 16).",
              multiple=True)
@sizes_option("--size", "kernel_sizes", "Elements per tensor, e.g. 64K, 1M, 16M (repeat for several).")
@repeats_option()
@count_option("--threads", "threads", "torch thread count to measure every row at (repeat: --threads 1 --threads "
              "4). Default: 1 and torch's default.", multiple=True)
@output_options
def kernels() -> None:
    """Time the aggregation kernels (add_n, add_ loop, stack+sum, tree_reduce, accumulate_n), each at 1
    thread and at torch's default thread count, against the copy roofline at the same thread count."""


@bench.command(cls=ImplCommand, target=IMPL + "allreduce")
@nproc_option("Ranks to launch (torchrun is started for you).")
@sizes_option("--size", "message_sizes", "Message size in bytes, e.g. 4KiB, 1MiB, 64MiB (repeat for several).")
@click.option(
    "--impl",
    "impls",
    multiple=True,
    help="Row to include (repeat): gloo, shm, shm-comm, shm-zero-copy, dist-backend (dist.all_reduce on a "
    "'torchstrategies' group), ring, hierarchical, auto, loopback-roofline (raw TCP bytes between the ranks). "
    "gloo is always added. Default: all but hierarchical and auto (with --simulate-hosts: gloo, ring, "
    "hierarchical, dist-backend, loopback-roofline).",
)
@repeats_option("Interleaved rounds; the median over them is reported (default 3).")
@count_option("--simulate-hosts", "simulate_hosts", "Split the ranks into H simulated hosts "
              "(TORCHSTRATEGIES_HOST_ID per rank, nproc/H consecutive ranks each; H must divide --nproc), so "
              "HIERARCHICAL runs SHM inside a host and its inter-host stage between them. SHM rows are refused "
              "then.")
@count_option("--hosts", "hosts", "Run across N real hosts: N network namespaces, each with --nproc/N ranks "
              "(default --nproc N) and one veth into a switch, rate-limited by tc tbf to --link (needs root; "
              "every namespace and link is deleted afterwards, also on Ctrl-C). Rows: gloo, ring, hierarchical, "
              "auto, dist-backend; adds the fraction of the line rate, the bytes counted on each host's link per "
              "call against the plan's theory, and the time over the link's round trip.")
@click.option("--link", "link", default=None, help="With --hosts: each host's link rate per direction, tc's "
              "spelling (1gbit, 10gbit, 500mbit). Default 1gbit.")
@click.option("--delay-ms", "delay_ms", type=click.FloatRange(0), default=None, help="With --hosts: one-way delay "
              "each frame gets in the switch (a userspace forwarder; for small messages).")
@output_options
def allreduce() -> None:
    """Time all-reduce implementations side by side (launches torchrun with --nproc ranks).

    Per size and implementation: median time, algbw = size/time, busbw = algbw * 2(n-1)/n (nccl-tests'
    definitions), the speed-up over gloo, and the fraction of the loopback roofline's busbw. Every case's
    sum is checked on every rank before it is timed. The title carries the machine and its load average.

    \b
    Example (gloo vs RING vs the roofline, 3 sizes, 5 rounds):
      torchstrategies bench allreduce --nproc 2 --impl gloo --impl ring --impl loopback-roofline \\
          --size 4KiB --size 1MiB --size 64MiB --repeats 5 --json ar.json
    Between 2 hosts of 2 ranks on 1 Gbit/s links (as root):
      torchstrategies bench allreduce --hosts 2 --nproc 4 --link 1gbit --size 16MiB --size 64MiB
    """


def _tf_options(fn: Callable[..., None]) -> Callable[..., None]:
    """``--tf-python`` and ``--tf-inter-op``: the TF rows of ``bench train`` and ``bench inproc``."""
    fn = count_option("--tf-inter-op", "tf_inter_op", "TF inter-op threads for the TF rows (default: as many "
                      "as the torch threads, at most one per replica; TF computes on as many threads as torch: "
                      "intra-op = torch threads // inter-op).")(fn)
    return click.option(
        "--tf-python",
        "tf_python",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="A Python that has TensorFlow (e.g. a venv's bin/python): adds TF MirroredStrategy(2) and "
        "OneDeviceStrategy rows beside the compiled rows, and the column 'vs TF Mirrored(2)' from the same "
        "run. Default: $TORCHSTRATEGIES_TF_PYTHON if set (bench train), else no TF rows.",
    )(fn)


@bench.command(cls=ImplCommand, target=IMPL + "train")
@nproc_option("Workers to launch (torchrun is started for you).")
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    help="Strategy / implementation row to include (repeat). Default: all the module knows.",
)
@count_option("--steps", "steps", "Training steps timed per row.")
@count_option("--batch-size", "batch_size", "Batch size per rank.")
@repeats_option("Timed rounds per row.")
@click.option(
    "--parameter-server/--no-parameter-server",
    default=False,
    help="Add a ParameterServerStrategy row (its own torchrun job: chief, 1 ps and the workers).",
)
@click.option(
    "--in-process/--no-in-process",
    default=True,
    help="Add the in-process rows (bench inproc): strategy overhead per replica (MLP 64-64-10) and "
    "MirroredStrategy(2) eager vs torch.compile (MLP 784-1024-1024-10).",
)
@_tf_options
@count_option("--hosts", "hosts", "Run the workers across N real hosts: network namespaces on rate-limited links "
              "(--link; needs root), --nproc/N workers each; no in-process rows. E.g. --hosts 2 --link 1gbit "
              "--strategy ddp --strategy mwms-default --strategy mwms-pack-4MiB --strategy no-comm.")
@click.option("--link", "link", default=None, help="With --hosts: each host's link rate (1gbit, 10gbit). Default "
              "1gbit.")
@output_options
def train() -> None:
    """Training throughput (samples/s): torch DDP vs our strategies (launches torchrun)."""


@bench.command("train-ps", cls=ImplCommand, target=IMPL + "train_ps")
@nproc_option("Processes to launch: the chief, --num-ps parameter servers and the rest workers.", 3, 4)
@count_option("--num-ps", "num_ps", "Parameter servers (default 1).")
@count_option("--steps", "steps", "Scheduled steps timed per round.")
@count_option("--batch-size", "batch_size", "Batch per step (default 64).")
@repeats_option("Rounds; the median over them is reported (default 3).")
@output_options
def train_ps() -> None:
    """ParameterServerStrategy's training throughput (steps/s, bytes pulled/pushed per step) beside the same
    steps in one process (launches torchrun: chief, ps, workers)."""


@bench.command(cls=ImplCommand, target=IMPL + "inproc")
@count_option("--steps", "steps", "Timed steps (the compile rows: a tenth).")
@repeats_option("Interleaved rounds; the median over them is reported (default 3).")
@click.option(
    "--group",
    "groups",
    type=click.Choice(["overhead", "compile"]),
    multiple=True,
    help="Only these row groups (repeat). Default: both.",
)
@count_option("--threads", "threads", "torch intra-op threads (default: torch's).")
@_tf_options
@output_options
def inproc() -> None:
    """The in-process rows of bench train alone: strategy overhead per replica (MLP 64-64-10) and
    MirroredStrategy(2) eager vs torch.compile (MLP 784-1024-1024-10), in this process."""


@bench.command("ft-recovery", cls=ImplCommand, target=IMPL + "ft_recovery")
@nproc_option("Workers to launch (both jobs).", 2, 3)
@count_option("--steps", "steps", "Steps each job trains (default 120).")
@count_option("--kill-at", "kill_at", "The step in flight when worker 1 is killed (default 40).")
@count_option("--checkpoint-every", "checkpoint_every", "The restart path's checkpoint interval (default 25).")
@count_option("--batch-size", "batch_size", "Batch per worker (default 64).")
@output_options
def ft_recovery() -> None:
    """Time lost per worker failure: the fault-tolerant mode (survivors go on, the worker heals from a peer)
    against torchrun --max-restarts resuming from the last checkpoint, in one run."""


@bench.command("agreement", cls=ImplCommand, target=IMPL + "agreement")
@nproc_option("Ranks to launch.", 2, 2)
@count_option("--blocks", "blocks", "Pairs of blocks, one with the check and one without (default 40).")
@count_option("--steps", "steps", "Timed steps per block (default 25).")
@count_option("--batch-size", "batch_size", "Batch per rank (default 64).")
@output_options
def agreement() -> None:
    """What MultiWorkerMirrored's per-step agreement check costs a step on the benchmark MLP: blocks of steps
    with the check and without it alternated in one job (paired), and the check's own time in the step hooks."""
