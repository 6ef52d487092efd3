"""Real faults at chosen points of training, for the failure-handling tests.

A phase of a training step (forward, backward, optimizer step, checkpoint save) is a long
run of Python function calls, into zerotrain, PyTorch and the collectives. A point of the
phase is named by a number: the n-th call event on this thread while the phase runs, where
an event is zerotrain's code entering a function or calling one (a Python function or a
builtin: a collective, a file write). Calls deeper inside other libraries are not counted,
so the points spread over zerotrain's own steps rather than, say, a JSON encoder's inner
loop. :class:`CallCounter` counts a phase's events once, and :class:`FaultAt` then stops
(SIGSTOP) or kills (SIGKILL) the process when the n-th event of a later occurrence of the
phase is reached: a fault at an arbitrary but reproducible point, delivered by the kernel
as a real one would be.

Before the signal, the time and the function being entered are appended to a marker
file, so the test can measure how long the other ranks took to notice.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


def _ours(frame: FrameType, event: str) -> bool:
    """Whether a profile event is a call zerotrain's code makes or receives."""
    if event == "c_call":
        return frame.f_code.co_filename.startswith(_PACKAGE)
    if event != "call":
        return False
    caller = frame.f_back
    return frame.f_code.co_filename.startswith(_PACKAGE) or (
        caller is not None and caller.f_code.co_filename.startswith(_PACKAGE)
    )


class CallCounter:
    """Counts the call events of this thread inside a ``with`` block (``count``)."""

    def __init__(self) -> None:
        self.count = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if _ours(frame, event):
            self.count += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


@dataclass(frozen=True)
class Fault:
    """Stop or kill this process (``kind``: "stop" or "kill") at call event ``event`` of a
    phase, writing ``time where`` to ``marker`` first."""

    kind: str
    event: int
    marker: str

    def __post_init__(self) -> None:
        if self.kind not in SIGNALS:
            raise ValueError(f"fault kind must be one of {sorted(SIGNALS)}, got {self.kind!r}")
        if self.event < 1:
            raise ValueError(f"fault event must be >= 1, got {self.event}")

    def fire(self, where: str) -> None:
        """Write the marker, then deliver the signal to this process."""
        sys.setprofile(None)
        with open(self.marker, "a") as f:
            f.write(f"{time.time()!r} {where}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), SIGNALS[self.kind])


def _describe(frame: FrameType, event: str, arg: Any) -> str:
    if event == "c_call":
        return f"{getattr(arg, '__qualname__', repr(arg))} (builtin)"
    code = frame.f_code
    return f"{code.co_qualname} ({Path(code.co_filename).name}:{frame.f_lineno})"


class FaultAt:
    """Inside a ``with`` block, fire ``fault`` at its call event; if the block has fewer
    events, fire when it ends (still inside the phase: its last moment)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self._seen = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not _ours(frame, event):
            return
        self._seen += 1
        if self._seen == self.fault.event:
            self.fault.fire(f"event {self._seen}: {_describe(frame, event, arg)}")

    def __enter__(self) -> FaultAt:
        sys.setprofile(self._profile)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.setprofile(None)
        if kind is None:
            self.fault.fire(f"end of the phase after {self._seen} events")


def read_marker(marker: str | os.PathLike[str]) -> tuple[float, str] | None:
    """The time and place a fault fired at (the first line of ``marker``), or None."""
    try:
        line = Path(marker).read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    at, _, where = line.partition(" ")
    return float(at), where
