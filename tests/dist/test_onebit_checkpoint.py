"""Checkpoints of the 1-bit optimizers: the error feedback, 0/1 Adam's local-step buffers
and every counter travel with the checkpoint, so a job resumed on as many ranks continues
exactly as if uninterrupted; on another number of ranks the rank-local buffers start from
zero, and the log says so."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, make_model, train_steps, zerotrain_config
from zerotrain.testing.dist import run_distributed

OPTIONS = {
    "OneBitAdam": {"freeze_step": 3},
    # Saved in the middle of a local-step interval: ranks hold their own parameters,
    # momentum and accumulated moves.
    "ZeroOneAdam": {
        "var_freeze_step": 4,
        "var_update_scaler": 2,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "OneBitLamb": {"freeze_step": 3, "max_coeff": 0.3},
}


def _spec(optimizer: str, stage: int) -> RunSpec:
    lr = 2e-2 if optimizer == "OneBitLamb" else 2e-3
    return RunSpec(
        optimizer=optimizer,
        opt_params={"lr": lr, "weight_decay": 0.01, "eps": 1e-4, **OPTIONS[optimizer]},
        stage=stage,
        steps=16,
        clip=0.5,
        extra_config={"zero_optimization": {"stage": stage}},
    )


def _engine(spec: RunSpec):
    model = make_model(spec)
    engine, optimizer, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    return model, engine, optimizer


def _params(model) -> dict[str, torch.Tensor]:
    with zerotrain.zero.GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _uninterrupted(spec: RunSpec, path: str, at: int) -> dict[str, Any]:
    model, engine, _ = _engine(spec)
    train_steps(engine, spec, 0, at)
    engine.save_checkpoint(path)
    losses = train_steps(engine, spec, at, spec.steps)
    return {"losses": losses, "params": _params(model)}


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _resumed(spec: RunSpec, path: str, at: int) -> dict[str, Any]:
    torch.manual_seed(99)
    model, engine, optimizer = _engine(spec)
    messages = _Messages()
    logging.getLogger("zerotrain").addHandler(messages)
    engine.load_checkpoint(path)
    errors = [float(e.abs().sum()) for e in optimizer.worker_errors + optimizer.server_errors]
    losses = train_steps(engine, spec, at, spec.steps)
    return {
        "losses": losses,
        "params": _params(model),
        "messages": messages.lines,
        "error_mass": sum(errors),
    }


CASES = [
    ("OneBitAdam", 0),
    ("OneBitAdam", 1),
    ("ZeroOneAdam", 0),
    ("OneBitLamb", 0),
    ("OneBitLamb", 1),
]


@pytest.mark.parametrize(("optimizer", "stage"), CASES)
def test_resume_on_as_many_ranks_continues_exactly(tmp_path: Path, optimizer: str, stage: int):
    spec, at = _spec(optimizer, stage), 9
    whole = run_distributed(_uninterrupted, 2, spec, str(tmp_path), at)
    resumed = run_distributed(_resumed, 2, spec, str(tmp_path), at)
    for rank in range(2):
        assert resumed[rank]["error_mass"] > 0  # the buffers came back, not zeros
        pairs = zip(resumed[rank]["losses"], whole[rank]["losses"], strict=True)
        diff = max(abs(a - b) for a, b in pairs)
        assert diff <= 1e-6, (diff, resumed[rank]["losses"], whole[rank]["losses"])
        for name, value in whole[rank]["params"].items():
            assert (resumed[rank]["params"][name] - value).abs().max() <= 1e-6, name
        assert not any("reset to zero" in m for m in resumed[rank]["messages"])


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_resume_on_other_ranks_resets_the_rank_local_state(tmp_path: Path, optimizer: str):
    spec, at = _spec(optimizer, 0), 9
    run_distributed(_uninterrupted, 2, spec, str(tmp_path), at)
    resumed = run_distributed(_resumed, 3, spec, str(tmp_path), at)
    said = [m for m in resumed[0]["messages"] if "reset to zero" in m]
    assert len(said) == 1, resumed[0]["messages"]
    assert "ranks=2" in said[0], said[0]
    assert "ranks=3" in said[0], said[0]
    for rank in resumed:
        assert rank["error_mass"] == 0
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
