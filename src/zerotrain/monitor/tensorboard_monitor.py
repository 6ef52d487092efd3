"""``tensorboard``: TensorBoard event files through ``torch.utils.tensorboard``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from zerotrain.monitor.base import Event, checked_events, import_dependency
from zerotrain.monitor.policy import MonitorKind, MonitorPolicy


class TensorBoardMonitor:
    """Writes event files under ``<output_path>/<job_name>/`` (one ``SummaryWriter``)."""

    def __init__(self, policy: MonitorPolicy) -> None:
        """Open the event file.

        Raises:
            ValueError: ``policy.kind`` is not ``tensorboard``.
            ImportError: the ``tensorboard`` package is not installed (the message says what
                to install).
        """
        if policy.kind is not MonitorKind.TENSORBOARD:
            raise ValueError(
                f"TensorBoardMonitor needs a tensorboard policy, got {policy.kind.value}"
            )
        # torch.utils.tensorboard fails with a bare ImportError when the package is missing;
        # check first so the message names the package and the extra.
        import_dependency(MonitorKind.TENSORBOARD)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir: Path = policy.log_dir
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, events: Sequence[Event]) -> None:
        """Add each event as a scalar and flush (see :class:`Monitor`).

        Raises:
            RuntimeError: the monitor is closed.
        """
        if self._writer is None:
            raise RuntimeError(f"TensorBoardMonitor({self.log_dir}) is closed")
        for tag, value, step in checked_events(events):
            self._writer.add_scalar(tag, value, global_step=step)
        # SummaryWriter otherwise flushes every 120 s; a crash must not lose the last steps.
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
