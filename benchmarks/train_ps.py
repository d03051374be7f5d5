"""ParameterServerStrategy's steps/s (chief, 1 ps, 2 workers) beside the same steps in one process ->
results/train_ps.json, results/train_ps.png. Run from a clone: ``python benchmarks/train_ps.py`` (or
``make bench``); the arguments are what the figure was made with."""

from _figure import record

ARGS = ["--nproc", "4", "--num-ps", "1", "--steps", "50", "--repeats", "2"]

if __name__ == "__main__":
    record("train-ps", ARGS)
