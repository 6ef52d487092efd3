"""The fault-injection helper (zerotrain.testing.faults): counting a phase's call events and
firing a real signal at a chosen one, in a child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerotrain.testing.faults import CallCounter, Fault, read_marker


def test_fault_arguments_are_checked():
    with pytest.raises(ValueError, match="fault kind must be one of"):
        Fault("pause", 1, "/tmp/x")
    with pytest.raises(ValueError, match="fault event must be >= 1"):
        Fault("kill", 0, "/tmp/x")


def test_only_zerotrain_calls_are_counted():
    from zerotrain.utils.norms import sum_squares

    with CallCounter() as empty:
        pass  # the counter's own exit: the baseline
    with CallCounter() as outside:
        sorted([3, 1, 2])  # a builtin called from here: not zerotrain's code
    with CallCounter() as ours:
        sum_squares([])  # enters zerotrain, which calls torch
    assert outside.count == empty.count
    assert ours.count >= empty.count + 2


_CHILD = textwrap.dedent(
    """
    import sys
    from zerotrain.testing.faults import Fault, FaultAt
    from zerotrain.utils.norms import sum_squares
    with FaultAt(Fault(sys.argv[1], int(sys.argv[2]), sys.argv[3])):
        for _ in range(5):
            sum_squares([])
    print("survived")
    """
)


@pytest.mark.parametrize(("event", "where"), [(3, "event 3:"), (10_000, "end of the phase")])
def test_a_fault_fires_as_a_real_signal(tmp_path: Path, event: int, where: str):
    marker = tmp_path / "fired"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, "kill", str(event), str(marker)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "survived" not in child.stdout
    fired = read_marker(marker)
    assert fired is not None
    assert where in fired[1], fired
