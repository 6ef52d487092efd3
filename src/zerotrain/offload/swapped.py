"""A tensor whose values live in a swap file and are resident in memory only on demand.

The tensor object keeps its identity while swapped out: its storage is resized to zero bytes
and grown again when the values are read back, so views made of it (a stage-3 parameter
shard, the optimizer's pieces of an fp32 master) stay valid across swaps, exactly as
``PartitionedParams`` frees and regrows its gathered buffer. The file is the source of truth;
a resident copy is a cache that whoever changes it writes back.
"""

from __future__ import annotations

import torch

from zerotrain.offload.aio import IOFuture
from zerotrain.offload.swap import SwapRegion
from zerotrain.utils.invariant import invariant


class SwappedTensor:
    """``tensor``'s values kept in ``region``; call ``materialize`` before reading it.

    Args:
        tensor: a contiguous 1-D tensor owning its whole storage (views of it are fine).
        region: where its values live, of the same size and dtype.

    On construction the current values are written to the region and the memory is freed.
    """

    def __init__(self, tensor: torch.Tensor, region: SwapRegion) -> None:
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
        self.resident = True
        self.write_back()
        self.drop()

    def prefetch(self) -> None:
        """Start reading the values back (no-op when resident or already reading)."""
        if self.resident or self._reading is not None:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self._reading = self.region.read(self.tensor)

    def materialize(self) -> torch.Tensor:
        """Make the values resident (waiting for a read in flight) and return the tensor."""
        self.prefetch()
        if self._reading is not None:
            reading, self._reading = self._reading, None
            # Resident from here on even if the wait raises, so that drop() frees the memory.
            self.resident = True
            reading.wait()
        return self.tensor

    def write_back(self) -> None:
        """Store the resident values in the file (after they were changed in memory)."""
        invariant(self.resident, "write-back of a swapped-out tensor")
        self.region.write(self.tensor).wait()

    def drop(self) -> None:
        """Free the resident copy (the file keeps the values)."""
        if self._reading is not None:
            reading, self._reading = self._reading, None
            reading.wait()  # never free memory a read still fills
        self.tensor.untyped_storage().resize_(0)
        self.resident = False

    @property
    def resident_bytes(self) -> int:
        """Bytes in memory now (the whole tensor while resident or being read, else 0)."""
        return self.nbytes if self.resident or self._reading is not None else 0
