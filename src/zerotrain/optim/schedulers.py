"""Learning-rate schedules with DeepSpeed's names, parameters and step semantics.

A schedule is a function of ``last_batch_iteration`` (the number of optimizer steps taken,
minus one; -1 before training). The engine calls ``step()`` after every optimizer step, so
optimizer step k (0-based) runs with the lr computed for iteration k - 1, exactly as in
DeepSpeed; loss curves therefore line up with runs of the same config there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

LrSpec = float | Sequence[float]


def per_group(optimizer: torch.optim.Optimizer, value: LrSpec, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, Sequence):
        if len(value) != groups:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {groups} groups"
            )
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_steps(steps: int, kind: str) -> int:
    """Validated warm-up length. A one-step log warm-up would divide by log(1) = 0, so it
    becomes two steps, as in DeepSpeed; 0 means no warm-up."""
    if kind not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {kind!r}")
    if steps < 0:
        raise ValueError(f"warmup_num_steps must be >= 0, got {steps}")
    return 0 if steps == 0 else max(2, steps)


def _warmup_fraction(iteration: int, warmup_steps: int, kind: str) -> float:
    """Progress through warm-up in [0, 1]: logarithmic (DeepSpeed's default) or linear."""
    if warmup_steps == 0 or iteration >= warmup_steps:
        return 1.0
    if iteration < 0:
        return 0.0
    if kind == "log":
        # log(1) = 0, so the first iteration starts exactly at the minimum.
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class Schedule:
    """Sets each param group's lr from ``lrs_at(last_batch_iteration)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []
        self._apply()

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = self.lrs_at(self.last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or jump to ``last_batch_iteration``) and set the lrs."""
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The lr of each param group, as last set."""
        return list(self._last_lr)

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the schedule."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`."""
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


class WarmupLR(Schedule):
    """lr rises from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then
    stays at ``warmup_max_lr`` (default: each param group's lr when the schedule is built).
    ``warmup_num_steps=0`` starts at ``warmup_max_lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: LrSpec | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.warmup_num_steps = _warmup_steps(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            self.max_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        else:
            self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def lrs_at(self, iteration: int) -> list[float]:
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from ``warmup_max_lr`` to 0 at ``total_num_steps``.

    ``warmup_max_lr`` defaults to the optimizer's lr, as for WarmupLR (DeepSpeed's
    WarmupDecayLR still defaults to 0.001; give the value explicitly to match it)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: LrSpec = 0.0,
        warmup_max_lr: LrSpec | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if total_num_steps < 1:
            raise ValueError(f"total_num_steps must be >= 1, got {total_num_steps}")
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """The optimizer's lr times a ratio that rises from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps``, then follows a half cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` and stays there."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if total_num_steps < 1:
            raise ValueError(f"total_num_steps must be >= 1, got {total_num_steps}")
        self.warmup_num_steps = _warmup_steps(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, iteration: int) -> float:
        """Multiplier of the base lr at ``iteration``."""
        if iteration < self.warmup_num_steps:
            frac = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * frac
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.base_lrs]
