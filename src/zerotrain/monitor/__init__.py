"""Training monitors: scalar series to TensorBoard, CSV files and Weights & Biases.

The engine builds one :class:`Monitors` from the ``tensorboard``, ``csv_monitor`` and
``wandb`` policies and calls ``write([(tag, value, step), ...])``; only rank 0 writes. Tag
names live in :mod:`zerotrain.monitor.tags`. See ``docs/monitors.md``.
"""

from __future__ import annotations

from zerotrain.monitor import tags
from zerotrain.monitor.base import (
    Event,
    Monitor,
    check_dependency,
    checked_events,
    import_dependency,
)
from zerotrain.monitor.csv_monitor import CSV_HEADER, CsvMonitor, csv_file_name
from zerotrain.monitor.fanout import Monitors, build_monitor
from zerotrain.monitor.policy import WANDB_MODES, MonitorKind, MonitorPolicy
from zerotrain.monitor.tags import memory_tag
from zerotrain.monitor.tensorboard_monitor import TensorBoardMonitor
from zerotrain.monitor.wandb_monitor import WandbMonitor

__all__ = [
    "CSV_HEADER",
    "WANDB_MODES",
    "CsvMonitor",
    "Event",
    "Monitor",
    "MonitorKind",
    "MonitorPolicy",
    "Monitors",
    "TensorBoardMonitor",
    "WandbMonitor",
    "build_monitor",
    "check_dependency",
    "checked_events",
    "csv_file_name",
    "import_dependency",
    "memory_tag",
    "tags",
]
