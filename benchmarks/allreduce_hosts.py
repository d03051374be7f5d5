"""All-reduce between 2 hosts of 2 ranks on 1 Gbit/s links (network namespaces, veth, tc tbf; needs root):
gloo, RING and HIERARCHICAL, busbw against the line rate, bytes on each link against the theory ->
results/allreduce_hosts.json, results/allreduce_hosts.png. Run from a clone as root: ``python
benchmarks/allreduce_hosts.py``; not part of ``make bench`` (which runs unprivileged)."""

from _figure import record

ARGS = ["--hosts", "2", "--nproc", "4", "--link", "1gbit", "--impl", "gloo", "--impl", "ring", "--impl",
        "hierarchical", "--size", "4KiB", "--size", "1MiB", "--size", "16MiB", "--size", "64MiB", "--repeats", "3"]

if __name__ == "__main__":
    record("allreduce", ARGS, stem="allreduce_hosts")
