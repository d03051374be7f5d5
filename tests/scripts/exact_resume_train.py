"""A small job whose resumed run must equal the uninterrupted one (tests/test_checkpoint_resume.py).

    torchrun --standalone --nproc_per_node=N --max-restarts=1 exact_resume_train.py OUT \
        --fault {sigkill,sigterm} --fault-step K [--batchnorm]
    torchrun --standalone --nproc_per_node=N exact_resume_train.py OUT --save-at K          # elastic: save
    torchrun --standalone --nproc_per_node=M exact_resume_train.py OUT --resume CKPT        # elastic: resume
    python exact_resume_train.py OUT --mirrored R --resume CKPT [--save-at K]              # in one process

The model: Linear, (BatchNorm1d,) ReLU, Dropout (fault runs; none in elastic runs, where each replica's
rows change), Linear; Adam; StepLR; a shuffled DataLoader of 48 samples in global batches of 8 (6 steps an
epoch). Fault runs: on attempt 0, rank 0 first trains the uninterrupted reference in the same processes
(OUT.reference), then the checkpointed run: SIGKILL -> rank 1 kills itself at the start of step K (a
checkpoint is saved after every step); SIGTERM -> rank 1 sends itself SIGTERM in step K
(PreemptionCheckpointHandler saves after it and exits 42). torchrun restarts the job, which resumes.
Rank 0 writes OUT: the final job state, each rank's final torch random state, the global batches (sample
ids) of every step run by this attempt, and OUT.attempts (one line per attempt).
"""

import argparse
import os
import random
import signal

import numpy as np
import torch
from torch.utils import _pytree as pytree

import torchstrategies as ts
from torchstrategies.checkpoint import Checkpoint, CheckpointManager, PreemptionCheckpointHandler

TOTAL_STEPS = 10
GLOBAL_BATCH = 8
SAMPLES = 48


def build(strategy, rank, dropout, batchnorm):
    torch.manual_seed(100 + rank)  # per-rank random state: the dropout masks differ between ranks
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g)
    y = torch.randint(0, 3, (SAMPLES,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES)),
                                         batch_size=GLOBAL_BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(11))
    with strategy.scope():
        layers = [torch.nn.Linear(6, 16)]
        if batchnorm:
            layers.append(torch.nn.BatchNorm1d(16))
        layers += [torch.nn.ReLU(), torch.nn.Dropout(0.3 if dropout else 0.0), torch.nn.Linear(16, 3)]
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = strategy.experimental_distribute_dataset(loader)

    def replica_step(batch):
        xb, yb, _ = batch
        opt.zero_grad()
        # Fault runs: Python's random and numpy feed the loss too, so their state matters as torch's does
        # (not in elastic runs, where each rank's share of the batch changes).
        noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand()) if dropout else 1.0
        loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum") * noise / GLOBAL_BATCH
        loss.backward()
        opt.step()

    def step(batch):
        strategy.run(replica_step, args=(batch,))
        sched.step()
        ids = strategy.gather(batch[2], axis=0)
        return [int(i) for i in ids.tolist()]

    return model, opt, sched, data, step


def job_state(strategy, model, opt, sched):
    """The state every rank agrees on (module buffers under the buffer rule), as a checkpoint saves it."""
    ext = strategy.extended if _multi_worker(strategy) else None
    objects = Checkpoint(model=model, optimizer=opt, sched=sched, save_random_state=False)._state(ext)
    state = {k: v["state"] for k, v in objects["objects"].items()}
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)  # a snapshot


def train(strategy, data, step, ckpt, until, after_step=None):
    """Runs steps until ``ckpt.step == until``; returns the sample ids of each step's global batch."""
    order = []
    while ckpt.step < until:
        for batch in data:
            order.append(step(batch))
            ckpt.step += 1
            if after_step is not None:
                after_step(ckpt.step)
            if ckpt.step >= until:
                break
    return order


def rng_states(strategy):
    mine = torch.get_rng_state().view(1, -1)
    return strategy.gather(mine, axis=0) if _multi_worker(strategy) else mine


def _multi_worker(strategy):
    return isinstance(strategy, ts.MultiWorkerMirroredStrategy)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--fault", choices=["sigkill", "sigterm"])
    p.add_argument("--fault-step", type=int, default=4)
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--save-at", type=int)
    p.add_argument("--resume")
    p.add_argument("--mirrored", type=int)
    a = p.parse_args()
    if a.mirrored:
        strategy = ts.MirroredStrategy(num_replicas=a.mirrored)
        rank = 0
    else:
        strategy = ts.MultiWorkerMirroredStrategy()
        rank = strategy.extended.rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        with open(a.out + ".attempts", "a") as f:
            f.write(f"{attempt}\n")
    dropout = a.fault is not None

    if a.fault is not None and attempt == 0:  # the uninterrupted reference, in the same processes
        model, opt, sched, data, step = build(strategy, rank, dropout, a.batchnorm)
        order = train(strategy, data, step, Checkpoint(step=0), TOTAL_STEPS)
        ref = {"state": job_state(strategy, model, opt, sched), "rng": rng_states(strategy), "order": order}
        if rank == 0:
            torch.save(ref, a.out + ".reference")

    model, opt, sched, data, step = build(strategy, rank, dropout, a.batchnorm)
    # Every rank's random state is in each checkpoint by default (save_random_state=True).
    ckpt = Checkpoint(model=model, optimizer=opt, sched=sched, data=data, step=0)
    result = {}
    if a.resume:
        ckpt.restore(a.resume)
        result["restored"] = job_state(strategy, model, opt, sched)
        result["restored_step"] = ckpt.step
    if a.fault is None:
        def save_at(s):
            if s == a.save_at:  # inside the loop: the data position is mid-epoch
                ckpt.save(a.out + ".ckpt")
                result["saved"] = job_state(strategy, model, opt, sched)

        order = train(strategy, data, step, ckpt, TOTAL_STEPS, after_step=save_at)
    elif a.fault == "sigkill":
        manager = CheckpointManager(ckpt, a.out + ".ckpts", max_to_keep=2)
        manager.restore_or_initialize()

        def save_after(s):
            manager.save()
            if rank == 1 and attempt == 0 and s == a.fault_step:
                os.kill(os.getpid(), signal.SIGKILL)  # no warning, mid-epoch, after the save of step s

        order = train(strategy, data, step, ckpt, TOTAL_STEPS, after_step=save_after)
    else:
        handler = PreemptionCheckpointHandler(CheckpointManager(ckpt, a.out + ".ckpts", max_to_keep=2))
        order = []
        while handler.total_run_calls < TOTAL_STEPS:
            for batch in data:
                if rank == 1 and attempt == 0 and handler.total_run_calls == a.fault_step:
                    os.kill(os.getpid(), signal.SIGTERM)  # preemption notice: finish this step, save, exit
                order.append(handler.run(step, batch))
                if handler.total_run_calls >= TOTAL_STEPS:
                    break
    result.update({"state": job_state(strategy, model, opt, sched), "rng": rng_states(strategy), "order": order,
                   "steps": ckpt.step})
    if rank == 0:
        torch.save(result, a.out)
    if _multi_worker(strategy):
        strategy.shutdown()


if __name__ == "__main__":
    main()
