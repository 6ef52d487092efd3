"""A tensor whose values live in a swap file and are resident in memory only on demand.

The tensor object keeps its identity while swapped out: its storage is resized to zero bytes
and grown again when the values are read back, so views made of it (a stage-3 parameter
shard, the optimizer's pieces of an fp32 master) stay valid across swaps, exactly as
``PartitionedParams`` frees and regrows its gathered buffer. The file is the source of truth;
a resident copy is a cache that whoever changes it writes back.
"""

from __future__ import annotations

from collections import deque

import torch

from zerotrain.offload.aio import IOFuture
from zerotrain.offload.swap import SwapRegion
from zerotrain.utils.invariant import invariant


class SwappedTensor:
    """``tensor``'s values kept in ``region``; call ``materialize`` before reading it.

    Args:
        tensor: a contiguous 1-D tensor owning its whole storage (views of it are fine).
        region: where its values live, of the same size and dtype.
        store: write the current values to the region first (False: they are zeros, which
            a fresh region already reads back as).

    On construction the memory is freed.
    """

    def __init__(self, tensor: torch.Tensor, region: SwapRegion, store: bool = True) -> None:
        invariant(tensor.device.type == "cpu", "only CPU tensors are swapped to files")
        invariant(
            tensor.dim() == 1
            and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(),
            "a swapped tensor must own its whole storage",
        )
        invariant(
            region.numel == tensor.numel() and region.dtype == tensor.dtype,
            "swap region does not match the tensor",
        )
        self.tensor = tensor
        self.region = region
        self.nbytes = tensor.numel() * tensor.element_size()
        self._reading: IOFuture | None = None
        self._writing: IOFuture | None = None
        self.resident = True
        if store:
            self.write_back()
        self.drop()

    def prefetch(self) -> None:
        """Start reading the values back (no-op when resident or already reading)."""
        if self.resident or self._reading is not None:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self._reading = self.region.read(self.tensor)

    def materialize(self, read: bool = True) -> torch.Tensor:
        """Make the values resident (waiting for a read or write in flight) and return the
        tensor; ``read=False``: only the memory, for a caller that overwrites every element."""
        self._settle()
        if not read and not self.resident and self._reading is None:
            self.tensor.untyped_storage().resize_(self.nbytes)
            self.resident = True
            return self.tensor
        self.prefetch()
        if self._reading is not None:
            reading, self._reading = self._reading, None
            # Resident from here on even if the wait raises, so that drop() frees the memory.
            self.resident = True
            reading.wait()
        return self.tensor

    def write_back(self) -> None:
        """Store the resident values in the file (after they were changed in memory)."""
        self.start_write_back()
        self._settle()

    def start_write_back(self) -> None:
        """Start storing the resident values; the next ``materialize``, ``drop`` or write
        waits for it, so the memory is neither changed nor freed while it is read."""
        invariant(self.resident, "write-back of a swapped-out tensor")
        self._settle()
        self._writing = self.region.write(self.tensor)

    def _settle(self) -> None:
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.wait()

    def drop(self) -> None:
        """Free the resident copy (the file keeps the values)."""
        self._settle()
        if self._reading is not None:
            reading, self._reading = self._reading, None
            reading.wait()  # never free memory a read still fills
        self.tensor.untyped_storage().resize_(0)
        self.resident = False

    @property
    def resident_bytes(self) -> int:
        """Bytes in memory now (the whole tensor while resident or being read, else 0)."""
        return self.nbytes if self.resident or self._reading is not None else 0


class WriteBehind:
    """Swapped tensors being written out, at most ``limit`` resident at once: each one is
    dropped once written, so producers (gradient reductions) run ahead of the disk by a
    bounded amount of memory."""

    def __init__(self, limit: int) -> None:
        invariant(limit >= 1, "write-behind needs room for one tensor")
        self.limit = limit
        self._pending: deque[SwappedTensor] = deque()

    def put(self, swapped: SwappedTensor) -> None:
        """Start writing ``swapped`` and drop it when written (oldest first)."""
        if swapped in self._pending:
            self._pending.remove(swapped)
        swapped.start_write_back()
        self._pending.append(swapped)
        while len(self._pending) > self.limit:
            self._pending.popleft().drop()

    def flush(self) -> None:
        """Wait for every write and drop what was written (before the files are read)."""
        while self._pending:
            self._pending.popleft().drop()
