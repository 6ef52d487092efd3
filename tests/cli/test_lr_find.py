"""``zerotrain lr-find`` end to end: a small MLP trained through ``zerotrain.initialize``
under torchrun, on 1 rank until the loss diverges and on 2 ranks (with gradient
accumulation) to the last step of the sweep. The recorded lrs must be DeepSpeed's
LRRangeTest exactly, the recorded loss the mean over micro-batches and ranks, and the
suggestion must lie inside the tested range."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Regression of a random linear map; every micro-batch's loss is appended to a per-rank
# file before engine.step(), so the test can average them itself.
SCRIPT = """
import sys
import torch
import zerotrain

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
config = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": int(sys.argv[1]),
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
}
engine, _, _, _ = zerotrain.initialize(model=model, config=config)
rank = engine.comm.rank
data = torch.Generator().manual_seed(1 + rank)
w = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
for _ in range(1000):
    x = torch.randn(16, 8, generator=data)
    loss = torch.nn.functional.mse_loss(engine(x), x @ w)
    with open(f"{sys.argv[2]}/losses{rank}.txt", "a") as f:
        f.write(f"{loss.item()!r}\\n")
    engine.backward(loss)
    engine.step()
print("the script went on after the sweep", flush=True)
"""


def _lr_find(tmp_path: Path, nproc: int, accumulation: int, *options: str):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "zerotrain.cli.main", "lr-find", "-n", str(nproc)]
    proc = subprocess.run(
        [*command, *options, "--out", str(out), str(script), str(accumulation), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "ZEROTRAIN_COMM_TIMEOUT": "60", "OMP_NUM_THREADS": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "the script went on" not in output
    assert (out / "lr_range_test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((out / "lr_range_test.json").read_text()), proc.stdout


def _check_schedule_and_suggestion(result: dict) -> None:
    request = result["request"]
    records = result["records"]
    for record in records:  # DeepSpeed's formula: interval = completed steps / step_size
        interval = (record["step"] - 1) / request["step_size"]
        assert record["lr"] == request["min_lr"] * (1 + request["step_rate"] * interval)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    suggestion = result["suggestion"]
    lrs = [r["lr"] for r in records]
    assert lrs[0] <= suggestion["min_lr"] < suggestion["max_lr"] <= lrs[-1]
    assert result["scheduler"]["type"] == "OneCycle"


def test_single_rank_stops_when_the_loss_diverges(tmp_path):
    result, stdout = _lr_find(tmp_path, 1, 1, "--min-lr", "1e-3", "--max-lr", "3", "--steps", "40")
    _check_schedule_and_suggestion(result)
    records = result["records"]
    assert len(records) < 40
    assert "the loss diverged" in result["stopped"]
    assert result["suggestion"]["diverged"]
    losses = [float(x) for x in (tmp_path / "losses0.txt").read_text().split()]
    assert len(losses) == len(records)  # nothing ran after the last recorded step
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-6)
    assert '"cycle_max_lr"' in stdout
    assert "suggested lr range" in stdout


def test_two_ranks_average_their_losses_and_stop_at_the_last_step(tmp_path):
    result, _ = _lr_find(tmp_path, 2, 2, "--min-lr", "1e-4", "--max-lr", "0.03", "--steps", "12")
    _check_schedule_and_suggestion(result)
    records = result["records"]
    assert len(records) == 12
    assert "reached its last step (12)" in result["stopped"]
    assert records[-1]["lr"] == pytest.approx(0.03, rel=1e-12)
    per_rank = [
        [float(x) for x in (tmp_path / f"losses{rank}.txt").read_text().split()]
        for rank in range(2)
    ]
    assert [len(losses) for losses in per_rank] == [24, 24]  # 12 steps x 2 micro-batches
    for k, record in enumerate(records):
        mean = sum(losses[2 * k] + losses[2 * k + 1] for losses in per_rank) / 4
        assert record["loss"] == pytest.approx(mean, rel=1e-6)
