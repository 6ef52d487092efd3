"""DeepSpeed's 1Cycle and LR range test schedules (``OneCycle``, ``LRRangeTest``).

Same parameters, defaults, formulas and step semantics as DeepSpeed 0.19.5 (the step offsets
are the ``Schedule`` convention of ``schedulers.py``: optimizer step k runs with the values
for iteration k - 1). Two DeepSpeed behaviours kept on purpose, because configs depend on
them: with ``cycle_momentum`` the optimizer's betas become ``(momentum, 0.99)`` (the second
beta is fixed at 0.99 whatever the optimizer had), and momentum is cycled only for optimizers
with ``betas`` (an SGD-style optimizer keeps its momentum, with a warning).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerotrain.optim.schedulers import LrSpec, Schedule, per_group
from zerotrain.utils.logging import get_logger

_log = get_logger(__name__)

# DeepSpeed's OneCycle sets betas to (momentum, 0.99).
_SECOND_BETA = 0.99


class LRRangeTest(Schedule):
    """lr = ``lr_range_test_min_lr * (1 + step_rate * interval)``, ``interval`` = completed
    iterations / ``lr_range_test_step_size`` (floored when ``lr_range_test_staircase``): the
    learning rate grows without bound, to find the largest one that still trains."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: LrSpec = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if isinstance(lr_range_test_step_size, bool) or lr_range_test_step_size <= 0:
            raise ValueError(
                f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}"
            )
        self.min_lrs = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def increase_at(self, iteration: int) -> float:
        """The factor on the minimum lr at ``iteration``."""
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return 1.0 + self.step_rate * interval

    def lrs_at(self, iteration: int) -> list[float]:
        factor = self.increase_at(iteration)
        return [lr * factor for lr in self.min_lrs]


class OneCycle(Schedule):
    """One triangle cycle of the lr from ``cycle_min_lr`` up to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and back over ``cycle_second_step_size`` (default:
    the same), optionally in stairs; then ``cycle_min_lr / (1 + decay_lr_rate * t /
    decay_step_size)``. Momentum (the first beta) moves the opposite way between
    ``cycle_max_mom`` and ``cycle_min_mom`` and decays as ``cycle_max_mom * (1 +
    decay_mom_rate * t / decay_step_size)``. A ``decay_step_size`` (or rate) of 0 holds the
    values reached at the end of the cycle."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(
                f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}"
            )
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay_steps or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay_steps or math.isclose(decay_mom_rate, 0)
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.min_mom, self.max_mom, self.decay_mom_rate = (
            cycle_min_mom,
            cycle_max_mom,
            decay_mom_rate,
        )
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            _log.warning(
                "OneCycle: cycle_momentum is off: %s has no betas (as in DeepSpeed)",
                type(optimizer).__name__,
            )
        super().__init__(optimizer, last_batch_iteration)

    def scale_at(self, iteration: int) -> float:
        """Position in the cycle, 0 at ``cycle_min_lr`` and 1 at ``cycle_max_lr``."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs from the integer offset in the cycle, as DeepSpeed 0.19.5 does: the float
            # scale can land just under a stair at a half-cycle boundary.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self.scale_at(iteration)
        elif self.skip_lr_decay:
            lr = self.min_lr
        else:
            decayed = iteration - self.total_size + 1
            lr = self.min_lr / (1 + self.decay_lr_rate * decayed / self.decay_step_size)
        return [lr] * len(self.optimizer.param_groups)

    def momentum_at(self, iteration: int) -> float:
        """The first beta at ``iteration``."""
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale_at(iteration)
        if self.skip_mom_decay:
            return self.max_mom
        decayed = iteration - self.total_size + 1
        return self.max_mom * (1 + self.decay_mom_rate * decayed / self.decay_step_size)

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        if self.last_batch_iteration == -1:
            betas = (self.min_mom, _SECOND_BETA)  # DeepSpeed starts at cycle_min_mom
        else:
            betas = (self.momentum_at(self.last_batch_iteration), _SECOND_BETA)
        for group in self.optimizer.param_groups:
            group["betas"] = betas

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the schedule."""
        return {"last_batch_iteration": self.last_batch_iteration}
