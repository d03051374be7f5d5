"""All-reduce on 2 ranks of one host: gloo, our SHM and RING paths, the backend as DDP calls it, and the
loopback roofline -> results/allreduce.json, results/allreduce.png. Run from a clone: ``python
benchmarks/allreduce.py`` (or ``make bench``); the arguments are what the figure was made with."""

from _figure import record

ARGS = ["--nproc", "2", "--impl", "gloo", "--impl", "shm", "--impl", "dist-backend", "--impl", "ring",
        "--impl", "loopback-roofline", "--size", "4KiB", "--size", "1MiB", "--size", "16MiB", "--repeats", "3"]

if __name__ == "__main__":
    record("allreduce", ARGS)
