"""Where a unit's states keep their values between uses: one protocol, two kinds.

A unit has up to three states with storage of their own: the fp32 master slice (mixed
precision, or an optimizer offloaded from an accelerator), the gradient slice (stages 2-3)
and the stage-3 parameter shard. Each is a 1-D tensor whose identity never changes (the
optimizer's pieces and the parameters are views of it). A ``SlotStorage`` holds one of them
and says where its values are: in memory for good (``ResidentSlot``, here), or in a file
and in memory only on demand (``offload.swapped.SwappedSlot``, NVMe offload).

The unit calls the same operations whatever the kind; on a resident slot they cost nothing.
Which kind each state gets is decided once, when the unit is built, by the
``StatePlacement`` the builder hands it (``ResidentPlacement`` by default, ``offload.Offload``
under NVMe offload). So shard/ never asks what kind of storage it holds and never imports
offload/: offload/ implements this protocol, as FSDP2's parameters never know which
collective implementation serves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from zerotrain.utils.norms import shard_squared_norms


class SlotStorage(Protocol):
    """The storage of one state of a unit (``tensor``); see the module docstring."""

    @property
    def tensor(self) -> torch.Tensor:
        """The state's tensor (the same object for the unit's life; views of it stay valid,
        though they read garbage while the values are not resident)."""
        ...

    @property
    def resident(self) -> bool:
        """Whether the values are in memory now."""
        ...

    @property
    def resident_bytes(self) -> int:
        """Bytes the values take in memory now (what ``memory_breakdown()`` counts)."""
        ...

    @property
    def streamed(self) -> bool:
        """Whether the offloaded optimizer step reads and writes the values where they live,
        chunk by chunk: the unit then leaves them to it (it neither binds them as gradients,
        scales them, nor publishes them in memory)."""
        ...

    def materialize(self, read: bool = True) -> torch.Tensor:
        """Make the values resident and return ``tensor``; ``read=False``: only the memory,
        for a caller that overwrites every element."""
        ...

    def prefetch(self) -> None:
        """Start making the values resident, ahead of a ``materialize``."""
        ...

    def write_back(self) -> None:
        """Store values changed in memory where they live (they stay resident)."""
        ...

    def drop(self) -> None:
        """Free the resident copy, if the values live elsewhere too."""
        ...

    def stow(self, final: bool) -> None:
        """The values were changed in memory and are not needed until the next
        ``materialize``: store them and free the memory once stored. ``final``: the last
        change of the accumulation window, whose sum of squares ``squared_norm`` reports
        (taken on the way out, so clipping never reads stored values back)."""
        ...

    def squared_norm(self, values: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Sum of squares of the values (0-d fp64): of ``values()`` (how to read them in
        memory, in the dtype the norm is taken in) when they are resident for good, else
        the sum recorded by the last final ``stow``."""
        ...

    def zero_(self, unread: bool) -> None:
        """Set every value to zero. ``unread``: nothing reads the values before they are
        next overwritten whole, so storage that would have to write the zeros out may skip
        it."""
        ...


class ResidentSlot:
    """Values in memory for the unit's life: every operation but ``zero_`` does nothing.

    Args:
        tensor: the state's tensor.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        """The state's tensor."""
        return self._tensor

    @property
    def resident(self) -> bool:
        """Always: the values never leave memory."""
        return True

    @property
    def resident_bytes(self) -> int:
        """Bytes of the tensor."""
        return self._tensor.numel() * self._tensor.element_size()

    @property
    def streamed(self) -> bool:
        """Never: the unit reads and updates the values in memory."""
        return False

    def materialize(self, read: bool = True) -> torch.Tensor:
        """The tensor (its values are resident)."""
        return self._tensor

    def prefetch(self) -> None:
        """Nothing to read."""

    def write_back(self) -> None:
        """Nothing to store: memory is where the values live."""

    def drop(self) -> None:
        """Nothing to free: memory is where the values live."""

    def stow(self, final: bool) -> None:
        """Nothing to store: memory is where the values live."""

    def squared_norm(self, values: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Sum of squares of ``values()``, taken now."""
        return shard_squared_norms([values()])[0]

    def zero_(self, unread: bool) -> None:
        """Zero the tensor in place (cheap in memory, so done even when ``unread``)."""
        self._tensor.zero_()


class StatePlacement(Protocol):
    """Decides the storage of each state of a unit, as the unit is built (the unit asks once
    every view of its states exists, so storage that moves values out may free them)."""

    def master(self, tensor: torch.Tensor) -> SlotStorage:
        """Storage for the fp32 master slice ``tensor``."""
        ...

    def grad_slice(self, tensor: torch.Tensor) -> SlotStorage:
        """Storage for the gradient slice ``tensor`` (stages 2-3; zeros)."""
        ...

    def param_shard(self, tensor: torch.Tensor, unit_numel: int) -> SlotStorage:
        """Storage for the stage-3 parameter shard ``tensor`` of a unit holding
        ``unit_numel`` parameter elements in all."""
        ...


class ResidentPlacement:
    """Every state stays in memory (no offload)."""

    def master(self, tensor: torch.Tensor) -> SlotStorage:
        """A resident slot."""
        return ResidentSlot(tensor)

    def grad_slice(self, tensor: torch.Tensor) -> SlotStorage:
        """A resident slot."""
        return ResidentSlot(tensor)

    def param_shard(self, tensor: torch.Tensor, unit_numel: int) -> SlotStorage:
        """A resident slot."""
        return ResidentSlot(tensor)


@contextlib.contextmanager
def held_in_memory(slots: Sequence[SlotStorage], write_back: bool) -> Iterator[None]:
    """Keep the values of ``slots`` resident for the duration; ``write_back``: store them
    afterwards (they were changed). Slots that were not resident before are dropped again."""
    was = [slot.resident for slot in slots]
    for slot in slots:
        slot.materialize()
    try:
        yield
    finally:
        for slot, resident in zip(slots, was, strict=True):
            if write_back:
                slot.write_back()
            if not resident:
                slot.drop()
