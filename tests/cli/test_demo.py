"""``zerotrain demo`` end to end: 2 ranks train, the loss falls, the plot and summary exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_demo_trains_and_writes_plot_and_summary(tmp_path: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotrain.cli.main",
            "demo",
            "--steps",
            "30",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    first, last = map(float, re.search(r"training loss: ([\d.]+) .* -> ([\d.]+)", summary).groups())
    assert last < first - 0.5, summary
    assert "2 ranks" in summary
    assert "peak memory per rank" in summary
    png = tmp_path / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
