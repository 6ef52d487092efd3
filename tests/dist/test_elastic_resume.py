"""Elastic training: one config with an ``elasticity`` section, run on 2 ranks, checkpointed,
resumed on 1 rank (a host lost) and on 4 (hosts added). The plan keeps the global batch (16 =
4 micro x 2 accumulation x 2 ranks = 4 x 4 x 1 = 4 x 1 x 4), the loader continues at the
saved global sample position, so the losses after the resize equal the uninterrupted 2-rank
run's within 1e-5 (fp32, stages 1 and 3, clipping active)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerotrain
from tests.helpers.training import RunSpec, global_batches
from zerotrain.testing.dist import run_distributed

ELASTIC = {
    "enabled": True,
    "max_train_batch_size": 16,
    "micro_batch_sizes": [2, 4],
    "min_gpus": 1,
    "max_gpus": 4,
    "version": 0.1,
}
STEPS, SAVE_AT = 6, 3


def _config(stage: int) -> dict[str, Any]:
    return {
        "elasticity": ELASTIC,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000},
        "steps_per_print": 1000,
    }


def _dataset() -> TensorDataset:
    spec = RunSpec(steps=40, micro_batch=2, grad_accum=1)
    windows = global_batches(spec, 4).flatten(0, 1)
    return TensorDataset(windows[:, :-1], windows[:, 1:])


def _run(stage: int, first: int, last: int, path: str, save: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = zerotrain.examples.gpt.GPT(RunSpec().model)
    engine, _, loader, _ = zerotrain.initialize(
        model=model, config=_config(stage), training_data=_dataset()
    )
    if first:
        engine.load_checkpoint(path)
    batches = iter(loader)
    gas = engine.gradient_accumulation_steps()
    losses = []
    for _ in range(first, last):
        total = 0.0
        for _ in range(gas):
            x, y = next(batches)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        losses.append(engine.comm.all_reduce_floats([total])[0] / (gas * dist.get_world_size()))
        if save and engine.global_steps == SAVE_AT:
            engine.save_checkpoint(path)
    split = (engine.train_micro_batch_size_per_gpu(), gas, engine.train_batch_size())
    engine.destroy()
    return {"losses": losses, "split": split}


@pytest.mark.parametrize("stage", [1, 3])
def test_elastic_job_resumed_on_fewer_and_more_ranks_continues_its_losses(tmp_path: Path, stage):
    path = str(tmp_path)
    whole = run_distributed(_run, 2, stage, 0, STEPS, path, True, timeout=300)[0]
    assert whole["split"] == (4, 2, 16)
    for world, split in ((1, (4, 4, 16)), (4, (4, 1, 16))):
        resumed = run_distributed(_run, world, stage, SAVE_AT, STEPS, path, False, timeout=300)
        assert resumed[0]["split"] == split
        worst = max(
            abs(a - b) for a, b in zip(resumed[0]["losses"], whole["losses"][SAVE_AT:], strict=True)
        )
        assert worst <= 1e-5, (world, resumed[0]["losses"], whole["losses"][SAVE_AT:])
