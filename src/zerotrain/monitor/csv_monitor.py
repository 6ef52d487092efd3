"""``csv_monitor``: one CSV file per series, ``step,value`` rows, flushed on every write."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path

from zerotrain.monitor.base import Event, checked_events
from zerotrain.monitor.policy import MonitorKind, MonitorPolicy

CSV_HEADER = ("step", "value")

# Anything that is not safe in a file name on every platform becomes "_"; this turns the
# tag's "/" into "_" as DeepSpeed does ("Train/Samples/lr" -> "Train_Samples_lr.csv").
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def csv_file_name(tag: str) -> str:
    """File name of a tag's series, e.g. ``"Train/Samples/lr"`` -> ``"Train_Samples_lr.csv"``."""
    return _UNSAFE.sub("_", tag) + ".csv"


class CsvMonitor:
    """Writes each series to ``<output_path>/<job_name>/<tag with / as _>.csv``.

    Files are opened in append mode for each write and closed again: the rows reach the OS
    before ``write`` returns (a crash loses nothing), no file handle per series stays open
    (there is one memory series per rank), and a resumed run appends to the same files.
    """

    def __init__(self, policy: MonitorPolicy) -> None:
        """Create the output folder.

        Raises:
            ValueError: ``policy.kind`` is not ``csv_monitor``.
            OSError: the folder cannot be created.
        """
        if policy.kind is not MonitorKind.CSV:
            raise ValueError(f"CsvMonitor needs a csv_monitor policy, got {policy.kind.value}")
        self.log_dir: Path = policy.log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._file_tag: dict[str, str] = {}  # file name -> the tag that owns it
        self._closed = False

    def path_for(self, tag: str) -> Path:
        """The CSV file holding ``tag``'s series."""
        return self.log_dir / csv_file_name(tag)

    def write(self, events: Sequence[Event]) -> None:
        """Append ``events`` as rows to each tag's file (see :class:`Monitor`).

        Raises:
            RuntimeError: the monitor is closed.
            ValueError: two different tags map to the same file name.
        """
        if self._closed:
            raise RuntimeError(f"CsvMonitor({self.log_dir}) is closed")
        rows: dict[str, list[tuple[int, float]]] = {}
        for tag, value, step in checked_events(events):
            rows.setdefault(tag, []).append((step, value))
        for tag, tag_rows in rows.items():
            self._append(tag, tag_rows)

    def _append(self, tag: str, rows: list[tuple[int, float]]) -> None:
        name = csv_file_name(tag)
        owner = self._file_tag.setdefault(name, tag)
        if owner != tag:
            # Without this, two series would silently interleave in one file.
            raise ValueError(f"csv_monitor: tags {owner!r} and {tag!r} both map to file {name}")
        path = self.log_dir / name
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(CSV_HEADER)
            # str(float) is the shortest repr that reads back to the same float.
            writer.writerows(rows)

    def close(self) -> None:
        """Mark the monitor closed; files are already complete after each write."""
        self._closed = True
