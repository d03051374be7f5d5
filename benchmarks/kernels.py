"""The aggregation kernels (accumulate_n, tree_reduce, add_n vs torch's add_ loop and stack+sum) against
the copy roofline -> results/kernels.json, results/kernels.png. Run from a clone: ``python
benchmarks/kernels.py`` (or ``make bench``); the arguments are what the figure was made with."""

from _figure import record

ARGS = ["--n", "2", "--n", "8", "--size", "1M", "--size", "16M", "--repeats", "5"]

if __name__ == "__main__":
    record("kernels", ARGS)
