"""Where a rank's CPU goes in an all-reduce across a rate-limited link: CPU seconds per GB and syscalls per call,
RING against gloo, in network namespaces (bench/netns.py; as root). Evidence that wall time under load does
not give: the CPU time a rank's process spends (user + system, all threads, getrusage) per byte it sends does
not count how long it waited for the link or for a core (but see the CPU limit below); ``--strace`` adds
``strace -f -c`` of rank 0 (syscall counts and kinds per call; strace slows the rank, so its wall time is not
the bench's).

Run (as root):
    python tests/scripts/profile_ring_link.py --hosts 2 --link 10gbit --size 16MiB --calls 20 [--strace]
    TORCHSTRATEGIES_RING_SOCKET_BYTES=4194304 python tests/scripts/profile_ring_link.py ...   # a knob's A/B

Prints one line per implementation: wall s/call, busbw Gbit/s and fraction of the line rate, CPU s per GB
sent (each rank sends 2(n-1)/n * size per call), user/system split, and the CPU limit: the cores a rank kept
busy (its CPU time over the wall time) and the cores it would need to send at the line rate (its CPU per
byte times the link's rate; ``nproc`` divided by the ranks on the machine is what each can have). The CPU a
rank is charged for includes the softirq work (the veth, bridge and tbf path, the peer's TCP) that ran while
it was on a CPU; under load part of that lands on other processes, so a loaded machine shows less CPU per GB
than a quiet one. With --strace rank 0's syscall table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from torchstrategies.bench.netns import IFACE, Network, handle_signals, parse_rate

RANK = r"""
import json, os, resource, sys, time
import torch, torch.distributed as dist
import torchstrategies
from torchstrategies.collectives import BackendOptions
from torchstrategies.strategies._mw_cluster import import_dynamo_first
impl, size, calls, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import_dynamo_first()  # before the group: else its gloo threads may abort the exit (_mw_cluster.py)
dist.init_process_group("gloo")
g = None if impl == "gloo" else dist.new_group(backend="torchstrategies", pg_options=BackendOptions(impl, 300))
x = torch.ones(size // 4)
for _ in range(3):
    dist.all_reduce(x, group=g)
dist.barrier()
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(calls):
    dist.all_reduce(x, group=g)
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
dist.barrier()
with open(out + str(dist.get_rank()), "w") as f:
    json.dump({"wall": wall, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
               "vcsw": r1.ru_nvcsw - r0.ru_nvcsw, "ivcsw": r1.ru_nivcsw - r0.ru_nivcsw}, f)
dist.destroy_process_group()  # its gloo threads end here, not in the interpreter's exit (_mw_cluster.py)
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--link", default="10gbit")
    p.add_argument("--size", default=str(16 << 20), help="bytes (or 16MiB)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--impls", default="gloo,RING")
    p.add_argument("--strace", action="store_true")
    a = p.parse_args()
    size = int(a.size[:-3]) << 20 if a.size.endswith("MiB") else int(a.size)
    rate = parse_rate(a.link)
    n = a.hosts * a.ranks_per_host
    sent = 2 * (n - 1) / n * size
    with handle_signals(), Network(a.hosts, rate) as net, tempfile.TemporaryDirectory() as tmp:
        for impl in a.impls.split(","):
            out = os.path.join(tmp, impl)
            procs = []
            for r in range(n):
                h = r // a.ranks_per_host
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR=net.address(0),
                           MASTER_PORT="29500", TORCHSTRATEGIES_HOST_ID=f"host{h}",
                           TORCHSTRATEGIES_RING_ADDR=net.address(h), GLOO_SOCKET_IFNAME=IFACE, OMP_NUM_THREADS="1")
                cmd = [sys.executable, "-c", RANK, impl, str(size), str(a.calls), out]
                if a.strace and r == 0:
                    cmd = ["strace", "-f", "-c", "-o", out + ".strace", *cmd]
                procs.append(net.popen(h, cmd, env))
            codes = [pr.wait(600) for pr in procs]
            if any(codes):
                raise SystemExit(f"{impl}: exit codes {codes}")
            ranks = [json.loads(open(out + str(r)).read()) for r in range(n)]
            wall = max(x["wall"] for x in ranks) / a.calls
            cpu = sum(x["user"] + x["sys"] for x in ranks) / n / a.calls
            bus = sent / wall * 8 / 1e9
            user = sum(x["user"] for x in ranks) / n / a.calls
            system = sum(x["sys"] for x in ranks) / n / a.calls
            print(f"{impl:6s} {size >> 20} MiB x{a.calls} on {a.hosts}x{a.ranks_per_host} @ {a.link}: "
                  f"{wall * 1e3:.1f} ms/call, busbw {bus:.2f} Gbit/s = {bus * 1e9 / rate:.1%} of line; "
                  f"CPU {cpu / sent * 1e9:.3f} s/GB sent per rank (user {user * 1e3:.1f} ms, sys "
                  f"{system * 1e3:.1f} ms per call); context switches per call and rank: voluntary "
                  f"{sum(x['vcsw'] for x in ranks) / n / a.calls:.0f}, involuntary "
                  f"{sum(x['ivcsw'] for x in ranks) / n / a.calls:.0f}", flush=True)
            at_line = cpu / sent * rate / 8  # CPU seconds per second of sending at the line rate
            print(f"{'':6s} CPU limit: {cpu / wall:.2f} cores busy per rank at this rate, {at_line:.2f} cores per "
                  f"rank needed at the line rate; {os.cpu_count()} CPUs for {n} ranks = "
                  f"{(os.cpu_count() or 1) / n:.2f} each", flush=True)
            if a.strace:
                print(subprocess.run(["head", "-25", out + ".strace"], capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
