"""Device helpers shared by the timers (wall clock, comms logger, activation checkpointing)."""

from __future__ import annotations

import torch


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device``: a CUDA device runs asynchronously to the host,
    so a timer that did not wait would measure only how long queueing took. Other devices
    (and None) compute synchronously: nothing to wait for."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class HostCopy:
    """A device value on its way to the host without the host waiting for it: on CUDA a
    non-blocking copy into pinned memory and an event behind it; elsewhere the tensor is in
    host memory already. ``get()`` waits for that event only (work queued after it goes on
    running), and reads memory, not the device: meant for a value read long after it was
    computed (the inf/NaN verdict of the previous optimizer step)."""

    def __init__(self, value: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            with torch.cuda.device(value.device):  # the copy and its event on one stream
                self._host.copy_(value, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
        elif value.device.type == "cpu":
            self._host = value
        else:  # other accelerators: a plain (blocking) copy
            self._host = value.cpu()

    def get(self) -> float:
        """The value (waits for the copy's event on CUDA)."""
        if self._event is not None:
            self._event.synchronize()
        return float(self._host.numpy())  # a read of host memory: no operation dispatched
