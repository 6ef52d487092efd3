"""The ecosystem examples run under ``zerotrain run -n 2`` (tiny sizes): the CIFAR
tutorial's script (only the import changed) learns its synthetic classes; the two-engine GAN
trains (the discriminator's two backward() calls per step included) and moves its samples
towards the ring; the transformers Trainer fine-tune saves a model that loads with its tie."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.cli.main", "run", "-n", "2", str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_cifar_tutorial_script_learns_at_stage_3():
    out = _run(
        "examples/cifar_deepspeed_style.py", "--stage", "3", "--epochs", "2", "--samples", "768"
    )
    accuracy = float(
        re.search(r"accuracy of the network on 512 held-out images: ([\d.]+) %", out)[1]
    )
    assert accuracy > 30.0, out  # chance is 10%


def test_gan_with_two_engines_trains_at_stage_2(tmp_path):
    config = {
        "train_batch_size": 64,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.5, 0.999]}},
        "zero_optimization": {"stage": 2},
    }
    path = tmp_path / "gan.json"
    path.write_text(json.dumps(config))
    out = _run(
        "examples/gan_two_engines.py",
        "--deepspeed",
        "--deepspeed_config",
        str(path),
        "--epochs",
        "3",
        "--samples",
        "1024",
    )
    found = re.search(r"distance from the ring: ([\d.]+) before, ([\d.]+) after", out)
    assert found, out
    assert float(found[2]) < float(found[1]), out


def test_trainer_finetune_example_saves_a_loadable_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run(
        "examples/trainer_finetune.py",
        "--stage",
        "3",
        "--max-steps",
        "4",
        "--output-dir",
        str(tmp_path / "model"),
    )
    assert "trainer_finetune: 4 steps" in out, out
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived
