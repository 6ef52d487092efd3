"""What a monitor is asked to do: one frozen policy per enabled config section.

Built by ``config`` from the ``tensorboard``, ``csv_monitor`` and ``wandb`` sections; nothing
here imports pydantic, so the monitors can be built and tested without a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

WANDB_MODES = ("online", "offline", "disabled")


class MonitorKind(StrEnum):
    """A monitor backend; the value is the config section that enables it."""

    TENSORBOARD = "tensorboard"
    CSV = "csv_monitor"
    WANDB = "wandb"

    @property
    def package(self) -> str | None:
        """The pip package (and top-level module) the backend needs, or None for none."""
        if self is MonitorKind.TENSORBOARD:
            return "tensorboard"
        if self is MonitorKind.WANDB:
            return "wandb"
        return None


@dataclass(frozen=True, slots=True)
class MonitorPolicy:
    """One monitor backend and where it writes.

    Attributes:
        kind: which backend.
        enabled: a disabled policy is skipped by :class:`~zerotrain.monitor.Monitors`, so a
            config section maps to a policy one to one.
        output_path: base folder; ``""`` means the current directory (DeepSpeed's default).
        job_name: sub-folder of ``output_path`` for this run (TensorBoard, CSV) and the run
            name (wandb).
        project: wandb project.
        group: wandb group, or None.
        team: wandb entity (team or user), or None for the logged-in default.
        mode: wandb mode, one of ``online``, ``offline``, ``disabled``; None lets wandb decide
            (``WANDB_MODE``, ``wandb offline``), which is how a job runs without network.
    """

    kind: MonitorKind
    enabled: bool = True
    output_path: str = ""
    job_name: str = "zerotrain_job"
    project: str = "zerotrain"
    group: str | None = None
    team: str | None = None
    mode: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, MonitorKind):
            allowed = ", ".join(f"MonitorKind.{k.name}" for k in MonitorKind)
            raise TypeError(f"MonitorPolicy.kind: got {self.kind!r}, expected one of {allowed}")
        if not self.job_name:
            raise ValueError(
                f"{self.kind.value}.job_name: must not be empty, got {self.job_name!r}"
            )
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(
                f"{self.kind.value}.mode: got {self.mode!r}, expected None or one of {WANDB_MODES}"
            )

    @property
    def log_dir(self) -> Path:
        """The folder this run's files go to: ``output_path / job_name``."""
        return Path(self.output_path) / self.job_name
