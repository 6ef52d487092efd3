"""``wandb``: Weights & Biases runs, online or offline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerotrain.monitor.base import Event, checked_events, import_dependency
from zerotrain.monitor.policy import MonitorKind, MonitorPolicy


class WandbMonitor:
    """Logs every series to one wandb run named after ``job_name``.

    With ``mode="offline"`` (or ``WANDB_MODE=offline``) nothing touches the network; the run
    is written under ``<output_path>/<job_name>/wandb/offline-run-*/`` (wandb's own default
    folder when ``output_path`` is empty) and can be uploaded later with ``wandb sync``.
    """

    def __init__(self, policy: MonitorPolicy) -> None:
        """Start the run.

        Raises:
            ValueError: ``policy.kind`` is not ``wandb``.
            ImportError: the ``wandb`` package is not installed (the message says what to
                install).
        """
        if policy.kind is not MonitorKind.WANDB:
            raise ValueError(f"WandbMonitor needs a wandb policy, got {policy.kind.value}")
        wandb = import_dependency(MonitorKind.WANDB)
        self.log_dir: Path | None = None
        if policy.output_path:
            self.log_dir = policy.log_dir
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=policy.project,
            group=policy.group,
            entity=policy.team,
            name=policy.job_name,
            dir=None if self.log_dir is None else str(self.log_dir),
            mode=policy.mode,
        )

    @property
    def run_dir(self) -> Path | None:
        """The folder of the run's local files (``.wandb`` log, ``files/``), None once closed."""
        return None if self._run is None else Path(self._run.dir).parent

    def write(self, events: Sequence[Event]) -> None:
        """Log the events, one ``run.log`` call per step (see :class:`Monitor`).

        wandb keeps one step counter per run and drops rows whose step went backwards, so
        steps must not decrease from one write to the next (the engine's sample count does
        not).

        Raises:
            RuntimeError: the monitor is closed.
        """
        if self._run is None:
            raise RuntimeError("WandbMonitor is closed")
        rows: dict[int, dict[str, float]] = {}
        for tag, value, step in checked_events(events):
            rows.setdefault(step, {})[tag] = value
        for step in sorted(rows):
            self._run.log(rows[step], step=step)

    def close(self) -> None:
        """Finish the run (writes its summary; in offline mode, closes the ``.wandb`` file)."""
        if self._run is not None:
            run, self._run = self._run, None
            run.finish()
