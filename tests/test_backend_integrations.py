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
