"""Reusable flat buffers that hold gradients on their way to a reduce-scatter (stage 2).

At ZeRO stage 2 the full-size gradient is never kept: each unit's gradients are copied into a
staging buffer (one foreach copy per unit), reduce-scattered into the unit's owned shard, and
the buffer is reused. Two buffers let one reduction run while the next unit fills.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from zerotrain.utils.invariant import invariant

T = TypeVar("T")


class StagingPool:
    """Up to ``count`` buffers of ``numel`` elements, allocated on first use.

    Args:
        numel: elements per buffer (the largest unit's padded size).
        dtype / device: of the gradients staged.
        count: buffers kept; ``acquire`` returns None when all are in use.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, count: int = 2):
        invariant(numel > 0 and count > 0, "staging pool needs a size and a count")
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.count = count
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        # Per (buffer, unit): the unit's parameter-shaped views of the buffer, made once.
        # A view per parameter per micro-step would be two host operations each (a slice
        # and a view), which on a GPU are launches the device waits for.
        self._views: dict[tuple[int, int], Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers allocated so far."""
        return self._allocated * self.numel * torch.tensor([], dtype=self.dtype).element_size()

    def acquire(self) -> torch.Tensor | None:
        """A free buffer, or None when ``count`` buffers are already in use."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.count:
            self._allocated += 1
            return torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return None

    def grow(self) -> torch.Tensor:
        """An extra buffer beyond ``count`` (when every buffer is held by a unit still
        filling, waiting for one would deadlock)."""
        self.count += 1
        buffer = self.acquire()
        invariant(buffer is not None, "staging pool failed to grow")
        return buffer  # type: ignore[return-value]

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer acquired from this pool."""
        self._free.append(buffer)

    def views(self, buffer: torch.Tensor, owner: object, make: Callable[[torch.Tensor], T]) -> T:
        """``make(buffer)``, the views ``owner`` (a unit's gradients) takes of a buffer of
        this pool, made on the first call for that pair and kept while the buffer is."""
        key = (id(buffer), id(owner))
        if key not in self._views:
            self._views[key] = make(buffer)
        found: T = self._views[key]
        return found

    def drop_idle(self) -> None:
        """Free the buffers no unit holds (``engine.offload_states``); they are allocated
        again on first use."""
        self._allocated -= len(self._free)
        self._free.clear()
        # The views keep their buffers alive; those of buffers still held are made again.
        self._views.clear()
