"""Stage-3 parameter storage: this rank's slice of a unit's flat buffer lives permanently;
the whole buffer exists only while the unit is gathered.

Between uses every parameter of the unit is an empty tensor (shape ``(0,)``): a layer that
uses a parameter of a released unit fails with a shape error instead of computing with stale
values (a reduction over it, such as an L2 penalty summed outside the model, sees an empty
tensor; use ``GatheredParameters`` there).

The whole buffer is one tensor for the unit's lifetime whose *storage* is freed (resized to
zero bytes) on release and reallocated on the next gather. Autograd keeps views of
parameters for backward (``weight.t()`` saved by a matmul); had each gather allocated a
fresh buffer, those views would keep every released buffer alive until backward, and the
whole model would be resident after the forward pass. With one storage they hold no memory
while released and see the same values again once the unit is gathered for backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.shard.layout import FlatLayout
from zerotrain.utils.invariant import invariant

if TYPE_CHECKING:
    from zerotrain.offload.swapped import SwappedTensor


def replace_storage(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``param`` (the same object) hold ``value``, even across devices (a parameter on
    the meta device cannot simply be given real data)."""
    replacement = nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, replacement)


class PartitionedParams:
    """One unit's parameters, partitioned over the ranks of ``layout``.

    Args:
        layout: packing of the parameters (``world_size`` = the data-parallel world size).
        params: the parameters, in ``layout`` order (their values are no longer read).
        rank: this rank (it keeps ``layout.shard_range(rank)``).
        shard: this rank's range of the flattened parameters (``copy_owned_range``), in the
            dtype the unit is gathered in; it becomes the permanent storage.
    """

    def __init__(
        self,
        layout: FlatLayout,
        params: Sequence[nn.Parameter],
        rank: int,
        shard: torch.Tensor,
    ) -> None:
        invariant(len(layout.params) == len(params), "layout and params differ in length")
        invariant(shard.numel() == layout.shard_numel, "shard size does not match the layout")
        self.layout = layout
        self.params = tuple(params)
        self.dtype = shard.dtype
        self.device = shard.device
        self.owned = layout.shard_range(rank)
        self.shard = shard
        # NVMe offload: ``shard`` lives in a swap file between uses and is read back for
        # each gather (``prefetch_shard`` starts that read ahead of need).
        self.swap: SwappedTensor | None = None
        self.full = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        self.gathered = True  # until the free() below
        self._released = torch.empty(0, dtype=self.dtype, device=self.device)
        for param in self.params:
            if param.is_meta:
                replace_storage(param, self._released)
        self.free()

    @property
    def nbytes(self) -> int:
        """Bytes of the permanent storage (this rank's slice) in memory now."""
        if self.swap is not None:
            return self.swap.resident_bytes
        return self.shard.numel() * self.shard.element_size()

    def drop_shard(self) -> None:
        """Free a swapped-out shard read back for a gather that has not happened."""
        if self.swap is not None and not self.gathered:
            self.swap.drop()

    def prefetch_shard(self) -> None:
        """Start reading a swapped-out shard back (ahead of its gather)."""
        if self.swap is not None:
            self.swap.prefetch()

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the whole buffer while gathered, else 0."""
        return self.full_nbytes if self.gathered else 0

    @property
    def full_nbytes(self) -> int:
        """Bytes the whole buffer takes when gathered."""
        return self.layout.padded_numel * self.shard.element_size()

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The part of a buffer-sized tensor ``flat`` that belongs to ``params[index]``."""
        spec = self.layout.params[index]
        return flat[spec.start : spec.end].view(spec.shape)

    def owned_slice(self, a: int, b: int) -> torch.Tensor:
        """Parameter values of ``[a, b)`` (inside this rank's range) in permanent storage."""
        lo, hi = self.owned
        invariant(lo <= a <= b <= hi, "slice outside the owned range")
        return self.shard[a - lo : b - lo]

    def gather(self, comm: Communicator, label: str) -> Handle:
        """Start assembling the whole buffer; parameters are views of it from now on (their
        values are valid once the handle is waited on)."""
        invariant(not self.gathered, "unit gathered twice")
        if self.swap is not None:
            self.swap.materialize()
        self.full.untyped_storage().resize_(self.full_nbytes)
        self.gathered = True
        for i, param in enumerate(self.params):
            param.data = self.view(self.full, i)
        # Refilling the buffer is not a change autograd must see: views saved for backward
        # hold exactly these values again.
        with torch.autograd._unsafe_preserve_version_counter(self.full):
            return comm.all_gather_into(
                self.full, self.shard, purpose="parameters", async_op=True, label=label
            )

    def refresh(self, comm: Communicator, label: str) -> Handle:
        """All-gather updated slices into the buffer already gathered (persistent units)."""
        invariant(self.gathered, "refresh of a unit that is not gathered")
        lo, hi = self.owned
        self.full[lo:hi].copy_(self.shard)
        return comm.all_gather_into(
            self.full, self.full[lo:hi], purpose="parameters", async_op=True, label=label
        )

    def scatter_back(self) -> None:
        """Copy this rank's slice of the gathered buffer into permanent storage (after the
        whole buffer was changed the same way on every rank)."""
        invariant(self.gathered, "unit not gathered")
        lo, hi = self.owned
        self.shard.copy_(self.full[lo:hi])
        if self.swap is not None:
            self.swap.write_back()

    def free(self) -> None:
        """Drop the gathered values; parameters become empty until the next gather."""
        for param in self.params:
            param.data = self._released
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        if self.swap is not None:
            self.swap.drop()

    def release(self) -> None:
        """Give every parameter its own full storage again (the unit must be gathered)."""
        invariant(self.gathered, "unit not gathered")
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()
                param.grad = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False
