"""``zerotrain demo`` end to end: 2 ranks train, the loss falls, the plot and summary exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from zerotrain.checkpoint.directory import read_latest


def _demo(out: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zerotrain.cli.main", "demo", "--steps", str(steps)]
    return subprocess.run(
        [*command, "--out-dir", str(out), "--save-every", "10", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_trains_and_writes_plot_and_summary(tmp_path: Path):
    proc = _demo(tmp_path, 20)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    first, last = map(float, re.search(r"training loss: ([\d.]+) .* -> ([\d.]+)", summary).groups())
    assert last < first - 0.5, summary
    assert "2 ranks" in summary
    assert "peak memory per rank" in summary
    png = tmp_path / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "global_step10",
        "global_step20",
        "latest",
        "latest.sha256",
    ]

    # Resuming with activation checkpointing on: the same model and checkpoint either way.
    resumed = _demo(tmp_path, 24, "--resume", "--checkpoint-activations")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert "at step 20" in resumed.stdout
    assert "activation checkpointing: 4 block(s)" in resumed.stdout + resumed.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "steps 21-24" in summary
    assert read_latest(checkpoints).tag == "global_step24"
