"""The wall-clock phases and the progress reporter, in one process."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from zerotrain.engine.wall_clock import PHASES, WallClock
from zerotrain.utils.progress import Progress


def test_wall_clock_adds_each_phase_and_reports_per_step():
    clock = WallClock(True, torch.device("cpu"))
    for _ in range(2):
        with clock.phase("forward"):
            time.sleep(0.01)
        with clock.phase("step"):
            pass
    ms = clock.per_step_ms(2)
    assert ms["forward"] >= 10.0
    assert ms["backward"] == 0.0
    line = clock.summary(2)
    assert line.startswith("wall clock per step (ms, 2 step(s)): forward ")
    assert "offload_io" not in line  # shown only once offloading takes time
    clock.reset()
    assert sum(clock.seconds.values()) == 0.0
    with pytest.raises(ValueError, match="unknown phase 'optimizer'; phases: forward"):
        clock.phase("optimizer")


def test_disabled_wall_clock_measures_nothing():
    clock = WallClock(False, torch.device("cpu"))
    with clock.phase("forward"):
        time.sleep(0.005)
    assert clock.seconds == dict.fromkeys(PHASES, 0.0)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = _Lines()
    logging.getLogger("zerotrain").addHandler(handler)
    yield handler.lines
    logging.getLogger("zerotrain").removeHandler(handler)


def test_progress_logs_a_line_per_tenth_off_a_terminal(monkeypatch, log_lines):
    monkeypatch.setenv("ZEROTRAIN_PROGRESS", "lines")
    with Progress(100, "copying") as p:
        for _ in range(50):
            p.update(2)
    lines = [line for line in log_lines if line.startswith("copying")]
    assert len(lines) == 10
    assert lines[0].startswith("copying: 10% (10 of 100 it)")
    assert lines[-1].startswith("copying: 100% (100 of 100 it)")


def test_progress_off_and_bad_setting(monkeypatch, log_lines):
    monkeypatch.setenv("ZEROTRAIN_PROGRESS", "off")
    with Progress(10, "quiet") as p:
        p.update(10)
    assert p.done == 10
    assert not [line for line in log_lines if "quiet" in line]
    monkeypatch.setenv("ZEROTRAIN_PROGRESS", "loud")
    with pytest.raises(ValueError, match="ZEROTRAIN_PROGRESS='loud': allowed values are auto"):
        Progress(10, "x")
