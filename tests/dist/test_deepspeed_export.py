"""``zerotrain convert --to deepspeed``: a zerotrain checkpoint as a DeepSpeed universal
checkpoint.

zerotrain loads one of DeepSpeed's fixtures, saves its own checkpoint and trains on
(its continuation is the reference). The checkpoint is converted, then loaded and trained
from again:

* by zerotrain (always): the continuation is the same, so the conversion loses nothing
  zerotrain reads back (weights, moments, step counts, schedule, counters, client state);
* by DeepSpeed 0.19.8, when ``ZEROTRAIN_DEEPSPEED_PYTHON`` names a Python that has it
  (outside the default suite: DeepSpeed is not a dependency). Its continuation equals
  zerotrain's within 1e-5 in fp32 and bf16's rounding in bf16. Run it with::

      python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8
      ZEROTRAIN_DEEPSPEED_PYTHON=/tmp/dsvenv/bin/python \
          .venv/bin/pytest tests/dist/test_deepspeed_export.py
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import zerotrain
from tests.helpers.deepspeed_fixtures import (
    AFTER,
    DATA,
    TinyNet,
    config,
    groups,
    train_steps,
)
from zerotrain.checkpoint.deepspeed_export import export_deepspeed_universal
from zerotrain.cli.main import main as zerotrain_cli
from zerotrain.testing.dist import run_distributed

DEEPSPEED_PYTHON = os.environ.get("ZEROTRAIN_DEEPSPEED_PYTHON")
# DeepSpeed's stage-3 universal loading gives every param group the settings of the first
# (its load_hp_checkpoint_state_from_checkpoint_dir_stage3), so where the groups differ (here
# in weight decay) no universal checkpoint continues the original run at stage 3, not even
# its own ds_to_universal output. There the reference is DeepSpeed's continuation from its
# own conversion of the same state, which ours must equal.
DEEPSPEEDS_OWN_CONVERSION = {"stage3_fp32": "universal_stage3_fp32"}
# (DeepSpeed fixture zerotrain starts from, ZeRO stage of both jobs)
CASES = [("stage2_fp32", 2), ("stage3_fp32", 3), ("stage1_bf16", 1)]


def _precision(fixture: str) -> str:
    return json.loads((DATA / fixture / "expected.json").read_text())["precision"]


def _train(engine: Any, start: int, precision: str) -> list[float]:
    return train_steps(engine, range(start, start + AFTER), precision)


def _engine(stage: int, precision: str, seed: int) -> Any:
    torch.manual_seed(seed)
    model = TinyNet()
    engine, _, _, _ = zerotrain.initialize(
        model=model, model_parameters=groups(model), config=config(stage, precision)
    )
    return engine


def _save_and_continue(fixture: str, stage: int, precision: str, save_dir: str) -> dict[str, Any]:
    """Start from DeepSpeed's checkpoint, save zerotrain's own, train on."""
    engine = _engine(stage, precision, seed=5)
    _, client = engine.load_checkpoint(str(DATA / fixture))
    engine.save_checkpoint(save_dir, client_state={k: client[k] for k in ("epoch", "note")})
    steps = engine.global_steps
    losses = _train(engine, steps, precision)
    lr = engine.get_lr()
    engine.destroy()
    return {"steps": steps, "losses": losses, "lr": lr}


def _load_converted(path: str, stage: int, precision: str) -> dict[str, Any]:
    engine = _engine(stage, precision, seed=6)
    _, client = engine.load_checkpoint(path)
    steps = engine.global_steps
    losses = _train(engine, steps, precision)
    result = {"steps": steps, "losses": losses, "lr": engine.get_lr(), "client": client}
    engine.destroy()
    return result


def _reference_and_conversion(
    fixture: str, stage: int, tmp_path: Path
) -> tuple[dict[str, Any], Path]:
    precision = _precision(fixture)
    reference = run_distributed(
        _save_and_continue, 2, fixture, stage, precision, str(tmp_path / "zt")
    )[0]
    assert (
        zerotrain_cli(["convert", str(tmp_path / "zt"), str(tmp_path / "ds"), "--to", "deepspeed"])
        == 0
    )
    return reference, tmp_path / "ds"


@pytest.mark.parametrize(("fixture", "stage"), CASES)
def test_converted_checkpoint_continues_in_zerotrain(
    fixture: str, stage: int, tmp_path: Path
) -> None:
    reference, converted = _reference_and_conversion(fixture, stage, tmp_path)
    assert (converted / "latest_universal").read_text() == "global_step3_universal"
    back = run_distributed(_load_converted, 2, str(converted), stage, _precision(fixture))[0]
    assert back["steps"] == reference["steps"] == 3
    torch.testing.assert_close(
        torch.tensor(back["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=0
    )
    assert back["lr"] == reference["lr"]
    assert back["client"]["epoch"] == 2
    assert back["client"]["note"] == "from DeepSpeed"


def test_export_refuses_what_deepspeed_cannot_continue(tmp_path: Path) -> None:
    """A save without optimizer states: refused with the alternative named."""
    run_distributed(_weights_only_save, 1, str(tmp_path / "zt"))
    with pytest.raises(
        zerotrain.checkpoint.errors.IncompatibleCheckpointError, match="consolidate"
    ):
        export_deepspeed_universal(tmp_path / "zt", tmp_path / "ds")


def _weights_only_save(save_dir: str) -> None:
    engine, *_ = zerotrain.initialize(model=TinyNet(), config={"train_batch_size": 2})
    engine.save_checkpoint(save_dir)
    engine.destroy()


def _deepspeed_continues(path: Path, stage: int, precision: str, out: Path) -> dict[str, Any]:
    """What DeepSpeed trains from universal checkpoint ``path`` (a subprocess in its venv)."""
    subprocess.run(
        [
            str(DEEPSPEED_PYTHON),
            "-m",
            "tests.helpers.deepspeed_fixtures",
            "continue",
            str(path),
            str(stage),
            precision,
            str(out),
        ],
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).parents[2])},
        timeout=300,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.skipif(
    DEEPSPEED_PYTHON is None,
    reason="needs DeepSpeed: set ZEROTRAIN_DEEPSPEED_PYTHON to a Python with deepspeed==0.19.8",
)
@pytest.mark.parametrize(("fixture", "stage"), CASES)
def test_converted_checkpoint_continues_in_deepspeed(
    fixture: str, stage: int, tmp_path: Path
) -> None:
    precision = _precision(fixture)
    reference, converted = _reference_and_conversion(fixture, stage, tmp_path)
    theirs = _deepspeed_continues(converted, stage, precision, tmp_path / "ours.json")
    assert theirs["loaded_steps"] == 3
    assert theirs["client"] == {"epoch": 2, "note": "from DeepSpeed"}
    if fixture in DEEPSPEEDS_OWN_CONVERSION:
        own = DATA / DEEPSPEEDS_OWN_CONVERSION[fixture]
        expected = _deepspeed_continues(own, stage, precision, tmp_path / "own.json")["losses"]
        tolerance = 0.0
    else:
        expected = reference["losses"]
        tolerance = 5e-3 if precision == "bf16" else 1e-5
    torch.testing.assert_close(
        torch.tensor(theirs["losses"]), torch.tensor(expected), rtol=tolerance, atol=0
    )
    assert theirs["lr"] == pytest.approx(reference["lr"], rel=1e-12)
