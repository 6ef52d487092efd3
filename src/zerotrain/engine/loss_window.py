"""The losses between two periodic reports, in bounded memory.

A run may print every 2,000 steps or never (the transformers Trainer); keeping each
micro-batch's loss tensor until the report held one small allocation per micro-step alive
in the middle of each step's freed activations, and the resident set grew by about a MiB
per step. The window folds each loss into one running sum as it arrives (on the loss's
device, so no synchronization), and keeps only the current step's losses, for the
per-step monitors.
"""

from __future__ import annotations

import torch


class LossWindow:
    """Running sum and count of micro-batch losses since the last report."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self.count = 0
        self._step: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        """Fold one micro-batch's loss in."""
        value = loss.detach().float().reshape(())
        if self._sum is None:
            self._sum = value.clone()
        else:
            self._sum.add_(value)
        self.count += 1
        self._step.append(value)

    def end_step(self) -> list[torch.Tensor]:
        """The losses of the step that just ended (then forgotten)."""
        losses, self._step = self._step, []
        return losses

    def mean(self) -> float:
        """The window's mean loss (0.0 when empty); one synchronization."""
        if self._sum is None or self.count == 0:
            return 0.0
        return float(self._sum.item()) / self.count

    def clear(self) -> None:
        """Start a new window."""
        self._sum, self.count, self._step = None, 0, []
