"""Training throughput on 2 workers: torch DDP (gloo and our backend) against MultiWorkerMirroredStrategy
per implementation -> results/train.json, results/train.png. Run from a clone: ``python
benchmarks/train.py`` (or ``make bench``); the arguments are what the figure was made with."""

from _figure import record

ARGS = ["--nproc", "2", "--strategy", "ddp", "--strategy", "ddp-torchstrategies", "--strategy", "mwms-default",
        "--strategy", "no-comm", "--steps", "30", "--repeats", "2", "--no-in-process"]

if __name__ == "__main__":
    record("train", ARGS)
