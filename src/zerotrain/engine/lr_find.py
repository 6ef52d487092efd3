"""``zerotrain lr-find`` inside the training job: the schedule it imposes and the recorder.

The command cannot reach into the user's script, so it speaks to ``zerotrain.initialize``
through one environment variable (``ZEROTRAIN_LR_FIND``, JSON) that torchrun hands to every
rank. When it is set, ``initialize`` replaces the config's ``scheduler`` with DeepSpeed's
``LRRangeTest`` and attaches an :class:`LRRangeRecorder` to the engine. After every
optimizer step the recorder averages the step's loss over the data-parallel ranks, rank 0
appends it to a JSON-lines file, and once the sweep is done (``max_steps``) or the loss has
diverged every rank leaves the script together with :class:`LRRangeTestFinished`, a
``SystemExit(0)``: the rest of the script is not run, and the job counts as a success.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.config.schema import SchedulerConfig, ZeroTrainConfig
from zerotrain.config.source import read_config_source
from zerotrain.optim.lr_finder import (
    DEFAULT_DIVERGENCE_FACTOR,
    DEFAULT_SMOOTHING,
    LossSmoother,
    LRRecord,
)
from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)

ENV_VAR = "ZEROTRAIN_LR_FIND"
ConfigSource = str | os.PathLike[str] | dict[str, Any] | ZeroTrainConfig | None


class LRRangeTestFinished(SystemExit):
    """Raised by ``engine.step()`` on every rank when the range test is over. A
    ``SystemExit`` with code 0, so the script stops without running its remaining steps and
    torchrun reports success; ``str()`` says why it stopped."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class LRFindRequest:
    """What ``zerotrain lr-find`` asks of the training job.

    Attributes:
        min_lr: the lr of the first step (``lr_range_test_min_lr``).
        step_rate: the lr grows by ``min_lr * step_rate`` per interval
            (``lr_range_test_step_rate``).
        step_size: steps per interval (``lr_range_test_step_size``).
        staircase: hold the lr for whole intervals (``lr_range_test_staircase``).
        max_steps: the job stops after this many optimizer steps.
        record_path: the JSON-lines file rank 0 appends one record per step to.
        divergence_factor: the job stops once the smoothed loss exceeds this multiple of
            its best.
        smoothing: beta of the loss's moving average, for the divergence test.
    """

    min_lr: float
    step_rate: float
    step_size: int = 1
    staircase: bool = False
    max_steps: int = 100
    record_path: str = "lr_range_test.jsonl"
    divergence_factor: float = DEFAULT_DIVERGENCE_FACTOR
    smoothing: float = DEFAULT_SMOOTHING

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.min_lr) and self.min_lr > 0):
            problems.append(f"min_lr must be positive, got {self.min_lr}")
        if not (math.isfinite(self.step_rate) and self.step_rate > 0):
            problems.append(f"step_rate must be positive, got {self.step_rate}")
        if isinstance(self.step_size, bool) or self.step_size < 1:
            problems.append(f"step_size must be an integer >= 1, got {self.step_size}")
        if isinstance(self.max_steps, bool) or self.max_steps < 1:
            problems.append(f"max_steps must be an integer >= 1, got {self.max_steps}")
        if not self.divergence_factor > 1:
            problems.append(f"divergence_factor must be > 1, got {self.divergence_factor}")
        if not 0 <= self.smoothing < 1:
            problems.append(f"smoothing must be in [0, 1), got {self.smoothing}")
        if problems:
            raise ValueError("LR range test: " + "; ".join(problems))

    # -- passing the request to the ranks ---------------------------------------------------

    def to_env(self) -> dict[str, str]:
        """The environment variable that carries this request to ``initialize``."""
        return {ENV_VAR: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LRFindRequest | None:
        """The request ``zerotrain lr-find`` set, or None when there is none.

        Raises:
            ValueError: the variable is not a JSON object of this class's fields.
        """
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        if not raw:
            return None
        try:
            fields = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{ENV_VAR} is not JSON ({err}): {raw[:200]!r}") from None
        allowed = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) - allowed:
            unknown = sorted(set(fields) - allowed) if isinstance(fields, dict) else fields
            raise ValueError(
                f"{ENV_VAR} must be a JSON object with keys among {sorted(allowed)}; "
                f"got {unknown!r}"
            )
        try:
            return cls(**fields)
        except TypeError as err:
            raise ValueError(f"{ENV_VAR}: {err}") from None

    # -- the schedule -----------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """The lr optimizer step ``step`` (from 1) runs with: DeepSpeed's LRRangeTest,
        ``min_lr * (1 + step_rate * interval)`` with ``interval`` = completed steps /
        ``step_size`` (floored with ``staircase``)."""
        interval = (step - 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return self.min_lr * (1.0 + self.step_rate * interval)

    def scheduler_section(self) -> dict[str, Any]:
        """The config's ``scheduler`` section for this sweep."""
        return {
            "type": "LRRangeTest",
            "params": {
                "lr_range_test_min_lr": self.min_lr,
                "lr_range_test_step_size": self.step_size,
                "lr_range_test_step_rate": self.step_rate,
                "lr_range_test_staircase": self.staircase,
            },
        }

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        """A copy of the raw config ``config`` with its ``scheduler`` replaced by the sweep
        (logged when the config had one)."""
        _log_replaced(config.get("scheduler"))
        return {**config, "scheduler": self.scheduler_section()}

    def override(self, source: ConfigSource, lr_scheduler: Any = None) -> ConfigSource:
        """The config source ``initialize`` was given, with the sweep's scheduler.

        Args:
            source: a dict, a JSON path, a loaded config, or None (``--config`` in argv).
            lr_scheduler: the scheduler passed to ``initialize``, which must be None.

        Raises:
            ValueError: the script passed its own ``lr_scheduler``.
        """
        if lr_scheduler is not None:
            raise ValueError(
                "zerotrain lr-find sets the learning rate through the config's 'scheduler' "
                "section, but the script passed lr_scheduler= to zerotrain.initialize; pass "
                "no scheduler (or one in the config) for the range test"
            )
        if isinstance(source, ZeroTrainConfig):
            _log_replaced(source.scheduler)
            section = self.scheduler_section()
            return source.model_copy(update={"scheduler": SchedulerConfig(**section)})
        raw, _ = read_config_source(source)
        return self.apply(raw)


def _log_replaced(section: Any) -> None:
    if section is None:
        return
    name = section.get("type") if isinstance(section, dict) else getattr(section, "type", None)
    log.info(
        "lr-find: the config's scheduler (%s) is replaced by LRRangeTest for the range test",
        name,
    )


class LRRangeRecorder:
    """Records each optimizer step of a range test and ends the job when it is over.

    Built by ``initialize`` (after the schedule has set the first lr) and called by
    ``engine.step()`` after every optimizer step.
    """

    def __init__(self, request: LRFindRequest, engine: Engine) -> None:
        lrs = engine.get_lr()
        if not lrs:
            raise ValueError(
                "zerotrain lr-find needs an optimizer: pass optimizer= to initialize or give "
                "the config an 'optimizer' section"
            )
        self.request = request
        self._path = Path(request.record_path)
        self._writes = engine.env.rank == 0
        self._smoother = LossSmoother(request.smoothing, request.divergence_factor)
        if self._writes:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._path.write_text("")

    def after_step(self, engine: Engine, losses: list[torch.Tensor]) -> None:
        """Record the step that just ended; raise :class:`LRRangeTestFinished` on every rank
        once the sweep is over or the loss has diverged.

        Args:
            engine: the engine that stepped (``global_steps`` already counts this step).
            losses: this rank's micro-batch losses of the step (scalar tensors).
        """
        # The rate this step ran at (the schedule has already moved the group on).
        rate = engine.get_lr_of_last_step()[0]
        record = LRRecord(engine.global_steps, rate, _mean_over_ranks(engine, losses))
        self._append(record.to_json())
        reason = self._stop_reason(record)
        if reason is not None:
            message = f"LR range test finished at step {record.step} (lr {record.lr:.4g}): {reason}"
            self._append({"stopped": message})
            log.info("%s", message)
            raise LRRangeTestFinished(message)

    def _stop_reason(self, record: LRRecord) -> str | None:
        """Why the test ends after ``record``, or None. Every rank sees the same averaged
        loss, so every rank reaches the same answer."""
        smoother = self._smoother
        smoothed = smoother.add(record.loss) if math.isfinite(record.loss) else math.nan
        best = smoother.best
        if smoother.diverged(smoothed):
            return (
                f"the loss diverged (smoothed {smoothed:.4g} > "
                f"{self.request.divergence_factor:g} x best {best:.4g})"
            )
        if record.step >= self.request.max_steps:
            return f"the sweep reached its last step ({self.request.max_steps})"
        return None

    def _append(self, obj: dict[str, Any]) -> None:
        """One JSON line, flushed at once so the command reads it whatever happens next."""
        if self._writes:
            with self._path.open("a", encoding="utf-8") as file:
                file.write(json.dumps(obj) + "\n")


def _mean_over_ranks(engine: Engine, losses: list[torch.Tensor]) -> float:
    """The step's loss averaged over micro-batches and the data-parallel ranks (one small
    all-reduce; non-finite on every rank when any rank's loss is)."""
    if losses:
        local = torch.stack([loss.detach().float().reshape(()) for loss in losses]).mean()
    else:
        local = torch.tensor(math.nan, device=engine.device)
    total = local.reshape(1).to(torch.float64)
    engine.comm.all_reduce(total, purpose="control")
    return float(total.item()) / engine.comm.world_size


def read_records(path: str | os.PathLike[str]) -> tuple[list[LRRecord], str | None]:
    """The records a range test wrote to ``path``, and the message it stopped with (None if
    it did not stop itself: the script ended first, or failed). A missing file reads as
    no records."""
    file = Path(path)
    if not file.is_file():
        return [], None
    records: list[LRRecord] = []
    stopped: str | None = None
    for line in file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if "stopped" in obj:
            stopped = str(obj["stopped"])
        else:
            records.append(LRRecord.from_json(obj))
    return records, stopped
