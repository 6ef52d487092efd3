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

    def forget_views(self) -> None:
        """Drop every view made so far (their owners are replaced; none is in use)."""
        self._views.clear()

    def drop_idle(self) -> None:
        """Free the buffers no unit holds (``engine.offload_states``); they are allocated
        again on first use."""
        self._allocated -= len(self._free)
        self._free.clear()
        # The views keep their buffers alive; those of buffers still held are made again.
        self._views.clear()


class StagingBatch:
    """Staging for several small units whose reductions travel as one collective (stage 3,
    ``zero/grad_sync.py``): each member stages into its own slice of one buffer drawn from
    ``pool``, the members' slices side by side in launch order.

    The buffer is drawn when the first member needs staging and goes back to ``pool`` once
    every member that drew its slice has released it.

    Args:
        pool: buffers of at least ``sum(numels)`` elements, shared by every batch.
        numels: the members' padded sizes, in launch order.
    """

    def __init__(self, pool: StagingPool, numels: list[int]) -> None:
        invariant(sum(numels) <= pool.numel, "staging batch larger than its pool's buffers")
        self.pool = pool
        self.numels = numels
        self.members = [BatchMember(self, k) for k in range(len(numels))]
        self._buffer: torch.Tensor | None = None
        self._holders: set[int] = set()

    def _slices(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        slices, start = [], 0
        for n in self.numels:
            slices.append(buffer[start : start + n])
            start += n
        return slices

    def acquire(self, k: int, grown: torch.Tensor | None = None) -> torch.Tensor | None:
        """Member ``k``'s slice (None when the batch has no buffer and the pool has none
        free; ``grown``: a buffer the pool just grew, to use)."""
        if self._buffer is None:
            self._buffer = grown if grown is not None else self.pool.acquire()
            if self._buffer is None:
                return None
        elif grown is not None:
            self.pool.release(grown)
        self._holders.add(k)
        return self.pool.views(self._buffer, self, self._slices)[k]

    def release(self, k: int) -> None:
        """Member ``k`` is done with its slice."""
        self._holders.discard(k)
        if not self._holders and self._buffer is not None:
            self.pool.release(self._buffer)
            self._buffer = None


class BatchMember:
    """What a unit of a :class:`StagingBatch` draws its staging from, in place of a
    :class:`StagingPool` (the same calls)."""

    def __init__(self, batch: StagingBatch, k: int) -> None:
        self.batch = batch
        self.k = k

    @property
    def count(self) -> int:
        return self.batch.pool.count

    def acquire(self) -> torch.Tensor | None:
        return self.batch.acquire(self.k)

    def grow(self) -> torch.Tensor:
        buffer = self.batch.acquire(self.k, grown=self.batch.pool.grow())
        invariant(buffer is not None, "staging batch failed to grow")
        return buffer  # type: ignore[return-value]

    def release(self, _buffer: torch.Tensor) -> None:
        self.batch.release(self.k)

    def views(self, buffer: torch.Tensor, owner: object, make: Callable[[torch.Tensor], T]) -> T:
        return self.batch.pool.views(buffer, owner, make)


# Where a unit's gradients are staged: a pool of its own dtype, or its slice of a batch.
StagingSource = StagingPool | BatchMember
