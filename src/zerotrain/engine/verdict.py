"""The inf/NaN verdict of an optimizer step, kept on the device and read a step later.

With ``non_finite_gradients.action: "skip"`` (the default under fp32 and bf16) and an
optimizer whose kernel skips on a device flag (fused Adam / AdamW), a step does not stop
the host to ask whether its gradients were finite. The optimizer gets ``found_inf``, a 0-d
tensor the norm produced, and leaves parameters, moments and step counts as they were when
it is set (as torch's ``GradScaler`` drives fused optimizers); the scheduler steps as for a
good step, its state kept to be put back. The verdict goes to the host without waiting
(``HostCopy``) and is read when the device has long produced it: before the next step's
update, or when something asks (``skipped_steps``, ``was_step_applied()``, ``get_lr()``, a
checkpoint). A skipped step is then counted, logged and, past ``max_consecutive_skips``,
raised: a step later than the synchronous verdict would (fp16's loss scaler, ``"raise"``
and optimizers without such a kernel keep deciding on the host before the step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.optim.base import GROUP_LAYOUT_KEYS
from zerotrain.utils.device import HostCopy


@dataclass
class PendingStep:
    """An optimizer step whose verdict is not read yet.

    Attributes:
        step: its number (1-based, as messages count).
        found_inf: 1.0 when its gradients held inf/NaN (the optimizer then skipped it).
        norm: its global gradient norm (0-d, on the device).
        squares: this rank's per-unit sums of squares behind the norm (to name a unit).
        prints: stage 3's exchanged gather fingerprints (ranks that gathered differently
            set ``found_inf`` too; None below stage 3).
        schedule: the scheduler's state before the step moved it (None: no scheduler).
        groups: the param groups' hyperparameters before the scheduler moved them (the
            rate, and what a schedule may move with it: momentum, betas).
    """

    step: int
    found_inf: HostCopy
    norm: torch.Tensor
    squares: list[tuple[int, torch.Tensor]]
    prints: torch.Tensor | None
    schedule: dict[str, Any] | None
    groups: list[dict[str, Any]]


def pending_step(
    step: int,
    found_inf: torch.Tensor,
    norm: torch.Tensor,
    squares: list[tuple[int, torch.Tensor]],
    prints: torch.Tensor | None,
    scheduler: Any,
    optimizer: torch.optim.Optimizer,
) -> PendingStep:
    """Record a step that ran with ``found_inf`` (call before the scheduler steps)."""
    schedule = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
    groups = [
        {key: copy.copy(value) for key, value in group.items() if key not in GROUP_LAYOUT_KEYS}
        for group in optimizer.param_groups
    ]
    return PendingStep(step, HostCopy(found_inf), norm, squares, prints, schedule, groups)


def undo_schedule(pending: PendingStep, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Put the scheduler and the rates back as they were before a skipped step (a skipped
    step does not advance the schedule, as in DeepSpeed)."""
    if pending.schedule is not None:
        scheduler.load_state_dict(pending.schedule)
    for group, saved in zip(optimizer.param_groups, pending.groups, strict=True):
        group.update(saved)
