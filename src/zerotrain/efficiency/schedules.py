"""The schedules of the training-efficiency features, as DeepSpeed 0.19.5 computes them.

Pure arithmetic on step counts (no torch): the progressive-layer-drop theta and per-layer
keep probabilities, the curriculum difficulty (a sequence length) and random-LTD's kept
token count. Each is a function of the global step, so a resumed run continues them from
the restored step without saved state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def pld_theta(step: int, theta: float, gamma: float) -> float:
    """Progressive layer drop's theta after ``step`` optimizer steps:
    ``(1 - theta) * exp(-gamma * step) + theta`` (1.0 at step 0, falling to ``theta``)."""
    # numpy's exp, as DeepSpeed's, so the values are bit-identical to its.
    return float((1.0 - theta) * np.exp(-gamma * step) + theta)


def keep_probability(layer: int, num_layers: int, theta: float) -> float:
    """The probability that layer ``layer`` (1-based, of ``num_layers``) runs:
    ``1 - layer / num_layers * (1 - theta)``; deeper layers are dropped more often, the last
    one with probability ``1 - theta``."""
    if not 1 <= layer <= num_layers:
        raise ValueError(f"layer {layer} is not in 1..{num_layers}")
    return 1.0 - layer / num_layers * (1.0 - theta)


def _fixed_root(step: int, total: int, low: int, high: int, multiple: int, degree: float) -> int:
    """DeepSpeed's fixed_root/fixed_linear value at ``step``: the root curve from ``low`` to
    ``high`` over ``total`` steps, floored, rounded down to a multiple of ``multiple``,
    capped at ``high``."""
    value = math.floor((float(step) / total) ** (1.0 / degree) * (high - low) + low)
    value -= value % multiple
    return min(value, high)


@dataclass
class CurriculumSchedule:
    """A curriculum difficulty schedule (DeepSpeed's CurriculumScheduler).

    ``schedule_type``: ``fixed_linear`` / ``fixed_root`` (``total_step``, ``difficulty_step``,
    ``root_degree``), ``fixed_discrete`` (``difficulty[i]`` up to and including step
    ``max_step[i]``, the last difficulty after), or ``custom`` (``custom(step)`` decides; set
    it with :meth:`set_custom`). As in DeepSpeed, the difficulty stops being recomputed once
    it reaches ``max_difficulty``.
    """

    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    total_step: int | None = None
    difficulty_step: int | None = None
    root_degree: float | None = None
    difficulty: Sequence[int] = ()
    max_step: Sequence[int] = ()
    custom: Callable[[int], int] | None = None
    current: int = field(init=False)

    def __post_init__(self) -> None:
        self.current = self.min_difficulty

    def set_custom(self, schedule: Callable[[int], int]) -> None:
        """The callback of a ``custom`` schedule: global step -> difficulty."""
        self.custom = schedule

    def difficulty_at(self, step: int) -> int:
        """The difficulty the schedule gives at ``step`` (ignoring the stop at max)."""
        kind = self.schedule_type
        if kind == "fixed_discrete":
            for difficulty, last in zip(self.difficulty, self.max_step, strict=False):
                if step <= last:
                    return difficulty
            return self.difficulty[-1]
        if kind in ("fixed_linear", "fixed_root"):
            if self.total_step is None or self.difficulty_step is None:
                raise ValueError(f"{kind} needs total_curriculum_step and difficulty_step")
            degree = 1.0 if kind == "fixed_linear" else self.root_degree
            if degree is None:
                raise ValueError("fixed_root needs root_degree")
            return _fixed_root(
                step,
                self.total_step,
                self.min_difficulty,
                self.max_difficulty,
                self.difficulty_step,
                degree,
            )
        if kind == "custom":
            if self.custom is None:
                raise RuntimeError(
                    "curriculum schedule_type 'custom' needs its callback: call "
                    "engine.set_custom_curriculum_learning_schedule(fn) before training"
                )
            return int(self.custom(step))
        raise ValueError(f"unknown curriculum schedule_type {kind!r}")

    def update(self, step: int) -> int:
        """Advance to ``step`` and return the current difficulty (DeepSpeed's
        ``update_difficulty``)."""
        if self.current < self.max_difficulty:
            self.current = self.difficulty_at(step)
        return self.current


@dataclass
class RandomLTDSchedule:
    """Random-LTD's kept-token schedule (DeepSpeed's RandomLTDScheduler, ``fixed_linear``):
    from ``min_value`` to ``max_value`` tokens over ``require_steps`` steps, in multiples of
    ``seq_per_step``. ``consumed_layer_tokens`` counts the layer-tokens trained on, as
    DeepSpeed reports it."""

    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int
    total_layers: int
    ltd_layers: int
    global_batch_size: int
    current: int = field(init=False)
    consumed_layer_tokens: int = 0
    last_step: int = -1

    def __post_init__(self) -> None:
        self.current = self.min_value

    def value_at(self, step: int) -> int:
        """Kept tokens at ``step`` (ignoring the stop at max)."""
        return _fixed_root(
            step, self.require_steps, self.min_value, self.max_value, self.seq_per_step, 1.0
        )

    def update(self, step: int) -> int:
        """Advance to ``step`` (each forward of a training step; counted once per step)."""
        if self.current < self.max_value:
            self.current = self.value_at(step)
        if step != self.last_step:
            dropped = self.current * self.ltd_layers
            full = self.max_value * (self.total_layers - self.ltd_layers)
            self.consumed_layer_tokens += self.global_batch_size * (dropped + full)
            self.last_step = step
        return self.current
