"""ZeroTrainStrategy against Lightning's own DDP, on real gloo ranks.

Every rank job runs through ``run_distributed`` (its process group is the one Lightning and
zerotrain find); one 2-rank job trains the same module and data under DDP and under
zerotrain stages 0-3 (importing Lightning costs seconds per process, so the runs share the
processes), and a 1-rank job resumes the stage-3 run's checkpoint with the same global batch.

The module steps plain SGD with momentum, not Adam: Adam is nearly blind to the scale of the
gradient, so a loss divided twice by the accumulation steps would pass unnoticed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from zerotrain.integrations.lightning import ZeroTrainStrategy  # noqa: E402
from zerotrain.integrations.lightning.config import engine_config  # noqa: E402
from zerotrain.testing.dist import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_gpt.py"
SAMPLES = 80  # 2 ranks x 10 micro-batches of 4: an epoch of 10, not a multiple of 3
MICRO = 4
ACCUMULATE = 3
EPOCHS = 2  # 20 micro-batches per rank


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Regression(pl.LightningModule):
    """Two same-type blocks, so stage 3 has block units besides the root unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16, bias=False)
        self.blocks = nn.ModuleList(_Block(16) for _ in range(2))
        self.head = nn.Linear(16, 1, bias=False)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _data(batch: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def _fit(strategy: Any, devices: int, epochs: int, batch: int, **kw: Any) -> _Regression:
    module = _Regression()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=kw.pop("clip", 1.0),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=kw.pop("callbacks", None),
    )
    trainer.fit(module, _data(batch), ckpt_path=kw.pop("ckpt_path", None))
    return module


class _SaveAfterFirstEpoch(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _parity_job(stages: list[int], checkpoint: str) -> dict[str, Any]:
    """Rank body: DDP, then zerotrain at each stage (stage 3 saves after epoch 1)."""
    out: dict[str, Any] = {}
    ddp = _fit("ddp", 2, EPOCHS, MICRO)
    out["ddp"] = (ddp.losses, _weights(ddp))
    for stage in stages:
        callbacks = [_SaveAfterFirstEpoch(checkpoint)] if stage == 3 else None
        name = f"zerotrain_stage_{stage}"
        module = _fit(name, 2, EPOCHS, MICRO, callbacks=callbacks)
        out[name] = (module.losses, _weights(module))
    return out


def _resume_job(checkpoint: str, batch: int) -> list[float]:
    module = _fit(ZeroTrainStrategy(stage=3), 1, EPOCHS, batch, ckpt_path=checkpoint)
    # The example on this rank too: this process has paid for importing Lightning already.
    spec = importlib.util.spec_from_file_location("lightning_gpt", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--devices", "1", "--max-steps", "2"])
    return module.losses


# Importing Lightning replaces torch.compile for good (to capture its arguments), and the
# Trainer's teardown removes WORLD_SIZE from the environment: a pooled rank would hand both
# to the next test.
LIGHTNING_PATCHES = "Lightning patches torch.compile on import and removes WORLD_SIZE"


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    checkpoint = str(tmp_path_factory.mktemp("lightning") / "after-epoch-1")
    results = run_distributed(
        _parity_job, 2, [0, 1, 2, 3], checkpoint, timeout=240, own_processes=LIGHTNING_PATCHES
    )
    return results, checkpoint


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_lightning_ddp(
    parity_runs: tuple[list[dict[str, Any]], str], stage: int
) -> None:
    """20 micro-batches, accumulate 3, epochs of 10: every stage's losses and final weights
    equal DDP's (the epoch's last, partial window steps with the loss divided by 3)."""
    results, _ = parity_runs
    for rank, out in enumerate(results):
        ddp_losses, ddp_weights = out["ddp"]
        losses, weights = out[f"zerotrain_stage_{stage}"]
        assert len(losses) == len(ddp_losses) == EPOCHS * SAMPLES // (2 * MICRO)
        torch.testing.assert_close(
            torch.tensor(losses, dtype=torch.float64),
            torch.tensor(ddp_losses, dtype=torch.float64),
            atol=1e-6,
            rtol=0,
            msg=lambda m, r=rank: f"rank {r}, stage {stage}: losses differ from DDP: {m}",
        )
        for key, value in ddp_weights.items():
            torch.testing.assert_close(weights[key], value, atol=1e-6, rtol=0)
        assert len(set(ddp_losses)) == len(ddp_losses)  # it trains


def test_resume_on_one_rank_continues_exactly(
    parity_runs: tuple[list[dict[str, Any]], str],
) -> None:
    """Saved by 2 ranks after epoch 1 (stage 3), resumed by 1 rank with the same global
    batch: epoch 2's losses equal the uninterrupted 2-rank run's (the mean of its ranks').
    The job also runs examples/lightning_gpt.py's main for 2 steps on that rank."""
    results, checkpoint = parity_runs
    [resumed] = run_distributed(
        _resume_job, 1, checkpoint, 2 * MICRO, timeout=120, own_processes=LIGHTNING_PATCHES
    )
    per_epoch = SAMPLES // (2 * MICRO)
    ranks = [out["zerotrain_stage_3"][0][per_epoch:] for out in results]
    expected = torch.tensor(ranks, dtype=torch.float64).mean(dim=0)
    assert len(resumed) == per_epoch
    torch.testing.assert_close(
        torch.tensor(resumed, dtype=torch.float64), expected, atol=1e-6, rtol=0
    )


def test_trainer_arguments_become_the_engine_config() -> None:
    cfg = engine_config(
        {"zero_optimization": {"overlap_comm": False}},
        stage=2,
        accumulate_grad_batches=3,
        gradient_clip_val=0.5,
        gradient_clip_algorithm="norm",
        precision="bf16-mixed",
    )
    assert cfg["zero_optimization"] == {"overlap_comm": False, "stage": 2}
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"] == {"enabled": True}
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        engine_config(
            {"gradient_accumulation_steps": 2},
            stage=None,
            accumulate_grad_batches=3,
            gradient_clip_val=None,
            gradient_clip_algorithm=None,
            precision="32-true",
        )
    with pytest.raises(ValueError, match="norm"):
        engine_config(
            {},
            stage=None,
            accumulate_grad_batches=1,
            gradient_clip_val=1.0,
            gradient_clip_algorithm="value",
            precision="32-true",
        )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_registered_names(stage: int) -> None:
    trainer = pl.Trainer(
        strategy=f"zerotrain_stage_{stage}",
        accelerator="cpu",
        devices=2,
        precision="bf16-mixed",
        logger=False,
    )
    assert isinstance(trainer.strategy, ZeroTrainStrategy)
    assert trainer.strategy.stage == stage
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.slow
def test_example_script_runs() -> None:
    """examples/lightning_gpt.py as a user runs it: Lightning launches the second rank
    (about 35 s on 2 busy cores, mostly importing Lightning twice; the resume test runs the
    example's main on its rank unmarked)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--max-steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lightning_gpt: done" in done.stdout + done.stderr
