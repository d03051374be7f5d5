"""Lightning and Accelerate on the "torchstrategies" backend (optional extras: skipped, with the reason, where
they are not installed; the core never needs them)."""

from __future__ import annotations

import pytest
from harness import run_ranks


def _lightning_body(rank: int, world: int) -> float:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    import torchstrategies  # noqa: F401

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        strategy=DDPStrategy(process_group_backend="torchstrategies"))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    import torch.distributed as dist

    assert dist.get_backend() == "torchstrategies"
    return float(model.net.weight.sum())


def _accelerate_body(rank: int, world: int) -> float:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    import torchstrategies  # noqa: F401

    dist.init_process_group("torchstrategies", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(3):
        accelerator.backward(model(torch.randn(4, 8) + rank).pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert dist.get_backend() == "torchstrategies"
    return float(accelerator.unwrap_model(model).weight.sum())


@pytest.mark.timeout(180)
def test_lightning_ddp_strategy_trains_on_the_backend_and_ranks_agree():
    pytest.importorskip("lightning", reason="Lightning is an optional extra (pip install lightning)")
    res = run_ranks(_lightning_body, 2, timeout=170, init_process_group=False)
    assert res[0] == res[1]


@pytest.mark.timeout(180)
def test_accelerate_adopts_the_backend_group_and_ranks_agree():
    pytest.importorskip("accelerate", reason="Accelerate is an optional extra (pip install accelerate)")
    res = run_ranks(_accelerate_body, 2, timeout=170, init_process_group=False)
    assert res[0] == res[1]


# ---------------------------------------------------------------- the one-line routes (issue 39)
def _accelerate_route_body(rank: int, world: int) -> tuple[float, str, str]:
    import torch
    import torch.distributed as dist

    from torchstrategies.integrations import accelerator

    acc = accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(4, 8) + rank).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return float(acc.unwrap_model(model).weight.sum()), str(dist.get_backend()), str(acc.state.backend)


@pytest.mark.timeout(180)
def test_accelerate_route_is_one_line_and_reports_the_backend_it_runs_on():
    pytest.importorskip("accelerate", reason="Accelerate is an optional extra (pip install -e '.[integrations]')")
    res = run_ranks(_accelerate_route_body, 2, timeout=170, init_process_group=False)
    assert res[0][0] == res[1][0]
    assert {r[1] for r in res} == {r[2] for r in res} == {"torchstrategies"}


def _trainer_route_body(rank: int, world: int, out: str) -> tuple[float, str, str]:
    import torch
    import torch.distributed as dist
    from transformers import Trainer

    from torchstrategies.integrations import training_arguments

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            pred = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)

        def __len__(self) -> int:
            return 32

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    args = training_arguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_train_epochs=1,
                              report_to=[], save_strategy="no", logging_strategy="no", learning_rate=0.1,
                              disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    model = Model()
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    trainer.train()
    return float(model.net.weight.sum()), str(dist.get_backend()), str(trainer.accelerator.state.backend)


@pytest.mark.timeout(240)
def test_hf_trainer_route_is_one_line_and_trains_on_the_backend(tmp_path):
    pytest.importorskip("transformers", reason="transformers is an optional extra (pip install -e '.[integrations]')")
    pytest.importorskip("accelerate", reason="Accelerate is an optional extra (pip install -e '.[integrations]')")
    res = run_ranks(_trainer_route_body, 2, args=(str(tmp_path),), timeout=230, init_process_group=False)
    assert res[0][0] == res[1][0]
    assert {r[1] for r in res} == {r[2] for r in res} == {"torchstrategies"}


def test_training_arguments_refuses_another_ddp_backend():
    pytest.importorskip("transformers", reason="transformers is an optional extra (pip install -e '.[integrations]')")
    from torchstrategies.integrations import training_arguments

    with pytest.raises(ValueError, match="ddp_backend='gloo'"):
        training_arguments(output_dir="x", ddp_backend="gloo")


# ---------------------------------------------------------------- after a strategy is gone (issue 39)
def _strategy_came_and_went() -> None:
    """A MirroredStrategy trains a step and is deleted; torch is then as it was before it."""
    import gc

    import torch
    from _torch_state import changes, snapshot

    import torchstrategies as ts

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # torch's own first-use patch of SGD.step
    before = snapshot()

    def train() -> None:
        s = ts.MirroredStrategy(num_replicas=2)
        with s.scope():
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step() -> None:
            opt.zero_grad()
            model(torch.ones(2, 2)).sum().backward()
            opt.step()

        s.run(step)

    train()  # the strategy, its model and optimizer are gone when it returns
    gc.collect()
    assert changes(before, snapshot()) == []


def _lightning_after(rank: int, world: int, strategy_first: bool) -> float:
    if strategy_first:
        _strategy_came_and_went()
    return _lightning_body(rank, world)


def _accelerate_after(rank: int, world: int, strategy_first: bool) -> float:
    if strategy_first:
        _strategy_came_and_went()
    return _accelerate_body(rank, world)


@pytest.mark.timeout(400)
def test_lightning_after_a_strategy_is_gone_trains_as_if_there_never_was_one():
    pytest.importorskip("lightning", reason="Lightning is an optional extra (pip install -e '.[integrations]')")
    after = run_ranks(_lightning_after, 2, args=(True,), timeout=190, init_process_group=False)
    never = run_ranks(_lightning_after, 2, args=(False,), timeout=190, init_process_group=False)
    assert after == never


@pytest.mark.timeout(400)
def test_accelerate_after_a_strategy_is_gone_trains_as_if_there_never_was_one():
    pytest.importorskip("accelerate", reason="Accelerate is an optional extra (pip install -e '.[integrations]')")
    after = run_ranks(_accelerate_after, 2, args=(True,), timeout=190, init_process_group=False)
    never = run_ranks(_accelerate_after, 2, args=(False,), timeout=190, init_process_group=False)
    assert after == never
