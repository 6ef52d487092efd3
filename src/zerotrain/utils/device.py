"""Device helpers shared by the timers (wall clock, comms logger, activation checkpointing)."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device``: a CUDA device runs asynchronously to the host,
    so a timer that did not wait would measure only how long queueing took. Other devices
    (and None) compute synchronously: nothing to wait for."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
