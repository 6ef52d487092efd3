"""Sharded checkpoints on real process groups: exact resume, resharding across world sizes
and stages, atomicity under SIGKILL, corruption and mismatch errors, consolidation."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    TINY,
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    zerotrain_config,
)
from zerotrain.checkpoint import (
    CheckpointNotFoundError,
    CheckpointReader,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    load_state_dict_from_checkpoint,
)
from zerotrain.checkpoint import regions
from zerotrain.checkpoint.safetensors_io import StreamingWriter
from zerotrain.testing.dist import DistributedTestError, run_distributed

DROPOUT = dataclasses.replace(TINY, dropout=0.1)


def _config(spec: RunSpec, world: int, precision: str | None) -> dict[str, Any]:
    config = zerotrain_config(spec, world)
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 5, "total_num_steps": 40},
    }
    if precision:
        config[precision] = {"enabled": True}
    if precision == "fp16":
        config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 4})
    return config


def _dataset(spec: RunSpec) -> TensorDataset:
    windows = global_batches(dataclasses.replace(spec, steps=30, grad_accum=1), 4).flatten(0, 1)
    return TensorDataset(windows[:, :-1], windows[:, 1:])


def _build(spec: RunSpec, precision: str | None, seed_offset: int = 0):
    torch.manual_seed(1234 + seed_offset)
    model = zerotrain.examples.gpt.GPT(spec.model)
    engine, _, loader, _ = zerotrain.initialize(
        model=model,
        config=_config(spec, dist.get_world_size(), precision),
        training_data=_dataset(spec),
    )
    return model, engine, loader


class _Batches:
    """Batches drawn from the loader, epoch after epoch, as a training loop would."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.it = iter(loader)

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def _train(engine, batches: _Batches, steps: int) -> list[float]:
    """Global mean losses of ``steps`` optimizer steps."""
    losses = []
    gas = engine.gradient_accumulation_steps()
    while len(losses) < steps:
        total = 0.0
        for _ in range(gas):
            x, y = next(batches)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        losses.append(engine.comm.all_reduce_floats([total])[0])
    return losses


def _train_save_train(spec: RunSpec, precision: str | None, path: str) -> list[float]:
    _, engine, loader = _build(spec, precision)
    batches = _Batches(loader)
    _train(engine, batches, 10)
    engine.save_checkpoint(path, client_state={"note": "ten steps", "step": 10})
    return _train(engine, batches, 10)


def _load_train(spec: RunSpec, precision: str | None, path: str) -> dict[str, Any]:
    # A different initialisation and RNG: everything must come from the checkpoint.
    _, engine, loader = _build(spec, precision, seed_offset=77)
    torch.manual_seed(5)
    loaded, client = engine.load_checkpoint(path)
    return {"losses": _train(engine, _Batches(loader), 10), "client": client, "path": loaded}


@pytest.mark.parametrize("precision", [None, "bf16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_continues_bitwise(tmp_path: Path, stage: int, precision: str | None) -> None:
    spec = RunSpec(stage=stage, model=DROPOUT, micro_batch=2, grad_accum=2)
    uninterrupted = run_distributed(_train_save_train, 2, spec, precision, str(tmp_path))
    resumed = run_distributed(_load_train, 2, spec, precision, str(tmp_path))
    assert resumed[0]["losses"] == uninterrupted[0]
    assert resumed[0]["client"] == {"note": "ten steps", "step": 10}
    assert resumed[0]["path"] == str(tmp_path / "global_step10")
    assert (tmp_path / "latest").read_text() == "global_step10"
