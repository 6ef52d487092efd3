"""The Accelerate recipe of docs/integrations.md, run: the ``Accelerator`` prepares only the
data loader (sharding the batches over 2 ranks), a zerotrain engine owns the model. The
losses and final weights equal one process training the same global batches (each step's
global batch is the two ranks' batches together) with plain PyTorch, at stages 0 and 3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import zerotrain  # noqa: E402
from zerotrain.testing.dist import run_distributed  # noqa: E402

BATCH, STEPS, LR = 4, 6, 0.05


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * 2 * STEPS, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(len(x), 1, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _recipe(stage: int) -> dict[str, Any]:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)
    loader = accelerator.prepare(loader)  # sharding and placement of batches, nothing else
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(engine.comm.all_reduce_floats([loss.item()])[0] / 2)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().clone() for p in model.parameters()]
    engine.destroy()
    return {"losses": losses, "params": params, "processes": accelerator.num_processes}


def _one_process() -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data().tensors
    losses = []
    for step in range(STEPS):
        # Accelerate hands batch 2k to rank 0 and 2k+1 to rank 1: together, one global batch.
        rows = slice(step * 2 * BATCH, (step + 1) * 2 * BATCH)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("stage", [0, 3])
def test_accelerate_prepares_the_data_and_zerotrain_trains(stage):
    result = run_distributed(_recipe, 2, stage, timeout=300)[0]
    reference = _one_process()
    assert result["processes"] == 2
    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-6, rel=0)
    for got, want in zip(result["params"], reference["params"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
