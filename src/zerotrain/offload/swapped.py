"""A tensor whose values live in a swap file and are resident in memory only on demand.

The tensor object keeps its identity while swapped out: its storage is resized to zero bytes
and grown again when the values are read back, so views made of it (a stage-3 parameter
shard, the optimizer's pieces of an fp32 master) stay valid across swaps, exactly as
``PartitionedParams`` frees and regrows its gathered buffer. The file is the source of truth;
a resident copy is a cache that whoever changes it writes back.

``SwappedSlot`` adapts a ``SwappedTensor`` to ``shard.storage.SlotStorage``, the protocol
through which units handle their states without knowing where they live.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from zerotrain.offload.aio import IOFuture
from zerotrain.offload.swap import SwapRegion
from zerotrain.utils.invariant import invariant
from zerotrain.utils.norms import shard_squared_norms


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


class SwappedSlot:
    """A unit's state kept in a swap file (``shard.storage.SlotStorage``): resident only
    while the unit uses it, and streamed through the offloaded optimizer step.

    Args:
        swapped: the state's tensor and its region.
        writer: stores changed values in the background and frees them once written
            (gradient slices: the backward pass runs ahead of the disk); None: ``stow``
            writes synchronously.
    """

    def __init__(self, swapped: SwappedTensor, writer: WriteBehind | None = None) -> None:
        self.swapped = swapped
        self._writer = writer
        # Sum of squares of the values as last stowed with ``final`` (0-d fp64): clipping
        # reads it instead of the file. A fresh region holds zeros.
        self._squares = torch.zeros((), dtype=torch.float64)

    @property
    def tensor(self) -> torch.Tensor:
        """The state's tensor (its storage is empty while swapped out)."""
        return self.swapped.tensor

    @property
    def region(self) -> SwapRegion:
        """Where the values live (the offloaded step reads and writes it directly)."""
        return self.swapped.region

    @property
    def resident(self) -> bool:
        """Whether the values are in memory now."""
        return self.swapped.resident

    @property
    def resident_bytes(self) -> int:
        """Bytes in memory now (while resident or being read back)."""
        return self.swapped.resident_bytes

    @property
    def streamed(self) -> bool:
        """Always: the offloaded step reads and writes the region chunk by chunk."""
        return True

    def materialize(self, read: bool = True) -> torch.Tensor:
        """Read the values back (``read=False``: only the memory) and return the tensor."""
        return self.swapped.materialize(read=read)

    def prefetch(self) -> None:
        """Start reading the values back."""
        self.swapped.prefetch()

    def write_back(self) -> None:
        """Store the resident values in the file."""
        self.swapped.write_back()

    def drop(self) -> None:
        """Free the resident copy (the file keeps the values)."""
        self.swapped.drop()

    def stow(self, final: bool) -> None:
        """Write the changed values out and free them once written; ``final``: take their
        sum of squares first."""
        if final:
            # The same function as for resident values, so clipping is bitwise unchanged.
            self._squares = shard_squared_norms([self.swapped.tensor])[0]
        if self._writer is not None:
            self._writer.put(self.swapped)
            return
        self.swapped.write_back()
        self.swapped.drop()

    def squared_norm(self, values: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The sum of squares taken by the last final ``stow`` (the file is not read)."""
        return self._squares

    def zero_(self, unread: bool) -> None:
        """Store zeros, unless ``unread`` (then the file keeps stale values that nothing
        reads before they are overwritten: no gradient's worth of writes for nothing)."""
        if unread:
            return
        self.swapped.materialize(read=False).zero_()
        self.stow(final=True)
