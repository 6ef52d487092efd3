"""``wall_clock_breakdown``: where a training step's time goes, phase by phase.

The engine brackets each phase of a micro-step; the totals are reported per optimizer step
every ``steps_per_print`` steps. On an accelerator each bracket synchronizes the device
(otherwise a phase would only measure how long it took to queue its kernels), so the
breakdown costs some overlap: turn it on to look, not for production runs. Disabled, a
phase is a shared no-op context.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from zerotrain.utils.device import synchronize

# forward: the model's forward. backward: autograd, with the gradient reductions launched
# from its hooks (overlapped). grad_comm_wait: after autograd, launching the remaining
# reductions and waiting for all of them: communication that backward did not hide.
# step: clipping, the optimizer update and, at stages 1-2, the all-gather of the updated
# parameters. offload_io: time blocked on moving optimizer state to or from CPU/NVMe
# (reported once offload exists).
PHASES = ("forward", "backward", "grad_comm_wait", "step", "offload_io")

_NO_TIMING = contextlib.nullcontext()


class WallClock:
    """Seconds spent per phase since the last ``reset``.

    Args:
        enabled: time at all (``wall_clock_breakdown``).
        device: the device the phases run on (synchronized around each phase if CUDA).
    """

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self._device = device
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Context that adds its duration to ``name`` (a no-op when disabled)."""
        if not self.enabled:
            return _NO_TIMING
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        synchronize(self._device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self._device)
            self.seconds[name] += time.perf_counter() - start

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count ``seconds`` of phase ``source`` as ``target`` instead (time the offloaded
        step spent waiting for the disk is offload_io, not step)."""
        if self.enabled and seconds > 0:
            self.seconds[source] -= seconds
            self.seconds[target] += seconds

    def per_step_ms(self, steps: int) -> dict[str, float]:
        """Milliseconds per optimizer step in each phase over ``steps`` steps."""
        return {name: 1000.0 * s / max(steps, 1) for name, s in self.seconds.items()}

    def summary(self, steps: int) -> str:
        """One line: each phase's milliseconds per step, and their sum (``offload_io`` only
        where offloading took time)."""
        ms = self.per_step_ms(steps)
        shown = {k: v for k, v in ms.items() if k != "offload_io" or self.seconds[k] > 0}
        parts = " | ".join(f"{name} {value:.1f}" for name, value in shown.items())
        return f"wall clock per step (ms, {steps} step(s)): {parts} | total {sum(ms.values()):.1f}"

    def reset(self) -> None:
        """Start a new reporting window."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
