"""Progress of a long operation: a tqdm bar on a terminal, plain log lines elsewhere.

A bar's carriage returns make a log file or a CI transcript unreadable, so when stderr is
not a terminal (or ``ZEROTRAIN_PROGRESS=lines``) the same progress goes to the logger as one
line per tenth of the work instead. ``ZEROTRAIN_PROGRESS=off`` silences both.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType

from tqdm import tqdm

from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_MODES = ("auto", "bar", "lines", "off")


def _mode() -> str:
    mode = os.environ.get("ZEROTRAIN_PROGRESS", "auto")
    if mode not in _MODES:
        raise ValueError(f"ZEROTRAIN_PROGRESS={mode!r}: allowed values are {', '.join(_MODES)}")
    if mode == "auto":
        return "bar" if sys.stderr.isatty() else "lines"
    return mode


class Progress:
    """Counts work done out of ``total`` and shows it.

    Args:
        total: units of work in all (bytes, tensors, steps).
        desc: what is being done, e.g. "consolidating global_step100".
        unit: name of one unit of work; "B" formats bytes with binary prefixes.
        enabled: False on ranks that should stay quiet.

    Use as a context manager; ``update(n)`` after each piece of work.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.unit = unit
        self.done = 0
        self.mode = _mode() if enabled else "off"
        self._next_line = 1  # the next tenth to log in "lines" mode
        self._start = time.perf_counter()
        self._bar: tqdm | None = None
        if self.mode == "bar":
            binary = unit == "B"
            self._bar = tqdm(
                total=self.total, desc=desc, unit=unit, unit_scale=binary, unit_divisor=1024
            )

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units of work done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "lines" and self.total:
            while self._next_line <= 10 and self.done * 10 >= self._next_line * self.total:
                self._log_line()
                self._next_line += 1

    def _log_line(self) -> None:
        elapsed = time.perf_counter() - self._start
        log.info(
            "%s: %d%% (%s of %s %s) in %.1f s",
            self.desc,
            min(100, 100 * self.done // self.total),
            self.done,
            self.total,
            self.unit,
            elapsed,
        )

    def close(self) -> None:
        """Finish the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
