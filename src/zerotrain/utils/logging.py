"""Rank-aware logging: the only output path of the library (``print`` lives in ``cli/`` only).

Every record carries the rank that emitted it. Informational records are shown on rank 0
only, so an N-rank job does not print everything N times; warnings and errors are shown on
every rank, because a problem on rank 3 is exactly what the user needs to see.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "zerotrain"


def _current_rank() -> int:
    # torchrun and our test harness both export RANK before any logging happens.
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankFilter(logging.Filter):
    """Stamps the rank on each record and drops INFO/DEBUG on ranks other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _current_rank()
        record.rank = rank
        if os.environ.get("ZEROTRAIN_LOG_ALL_RANKS") == "1":
            return True
        return rank == 0 or record.levelno >= logging.WARNING


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not any(getattr(h, "_zerotrain", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._zerotrain = True  # type: ignore[attr-defined]
        handler.setFormatter(
            logging.Formatter("[zerotrain rank%(rank)s] %(levelname)s %(message)s")
        )
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("ZEROTRAIN_LOG_LEVEL", "INFO").upper())
        # Our handler formats with the rank; do not print every record twice via the root.
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """Return the logger for a zerotrain module (``name`` is usually ``__name__``)."""
    _configure_root()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
