"""Real faults for the failure-handling tests: a small filesystem that fills up; and the
fault-injection suite's detection times, printed at the end of the run."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``path`` for the duration (root only: skipped
    with the reason elsewhere), unmounted on every exit path."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# One line per fault-injection cell that ran: what was lost and how soon the survivors
# named it (tests/conftest.py prints them in the run's summary, so CI's log has them).
DETECTIONS: list[str] = []


def report_detection(line: str) -> None:
    """Record (and print, for ``-s`` runs) one cell's detection time."""
    DETECTIONS.append(line)
    print(line)
