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

import enum
from collections.abc import Sequence

import torch
from torch import nn

from zerotrain.shard.io import CollectiveIO
from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.param_status import ZeroParamStatus, describe, forget, number, set_status
from zerotrain.shard.storage import ResidentSlot, SlotStorage, StatePlacement
from zerotrain.utils.invariant import invariant


class ShardState(enum.Enum):
    """Where a stage-3 unit's parameters are; every change goes through ``_move``, which
    refuses any transition not listed in ``_NEXT`` (an ordering bug raises at once)."""

    SHARDED = "sharded"  # only this rank's slice exists; the parameters are empty
    GATHERING = "gathering"  # the whole buffer is allocated; an all-gather is filling it
    GATHERED = "gathered"  # whole; the schedule frees it after use
    PINNED = "pinned"  # whole and kept (GatheredParameters; held across micro-batches)
    PERSISTENT = "persistent"  # whole for the engine's life (below the persistence threshold)
    DETACHED = "detached"  # the engine let go: parameters own their storage again


_NEXT: dict[ShardState, frozenset[ShardState]] = {
    ShardState.SHARDED: frozenset({ShardState.GATHERING, ShardState.DETACHED}),
    ShardState.GATHERING: frozenset({ShardState.GATHERED}),
    ShardState.GATHERED: frozenset(
        {ShardState.SHARDED, ShardState.PINNED, ShardState.PERSISTENT, ShardState.DETACHED}
    ),
    ShardState.PINNED: frozenset({ShardState.GATHERED, ShardState.DETACHED}),
    ShardState.PERSISTENT: frozenset({ShardState.DETACHED}),
    ShardState.DETACHED: frozenset(),
}
_WHOLE = frozenset(
    {ShardState.GATHERING, ShardState.GATHERED, ShardState.PINNED, ShardState.PERSISTENT}
)
# What each state shows scripts as ``param.ds_status`` (DeepSpeed's names; see param_status).
_STATUS = {
    ShardState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    ShardState.GATHERING: ZeroParamStatus.INFLIGHT,
    ShardState.GATHERED: ZeroParamStatus.AVAILABLE,
    ShardState.PINNED: ZeroParamStatus.AVAILABLE,
    ShardState.PERSISTENT: ZeroParamStatus.AVAILABLE,
}


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
        # Where ``shard`` lives between gathers: in memory, or (NVMe offload, see ``place``)
        # in a file, read back for each gather (``prefetch_shard`` starts that ahead of need).
        self.slot: SlotStorage = ResidentSlot(shard)
        self.full = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        # Each parameter's view of the buffer, and this rank's range of it, made once while
        # the storage has its size (a view is checked against it when made): they stay
        # valid as the storage is freed and resized back, so a gather points .data at them
        # without a slice and a view per parameter.
        self._full_views = [self.view(self.full, i) for i in range(len(self.params))]
        self.state = ShardState.GATHERED  # until the free() below
        self._pins = 0
        self._released = torch.empty(0, dtype=self.dtype, device=self.device)
        for param in self.params:
            if param.is_meta:
                replace_storage(param, self._released)
        describe(self.params, [spec.shape for spec in layout.params])
        self.free()

    def _move(self, new: ShardState, why: str) -> None:
        invariant(
            new in _NEXT[self.state],
            f"{why}: a unit that is {self.state.value} cannot become {new.value}",
        )
        self.state = new
        if new is ShardState.DETACHED:
            forget(self.params)
        else:
            set_status(self.params, _STATUS[new])

    def number(self, first: int) -> None:
        """Give the parameters DeepSpeed's ``ds_id`` ``first, first + 1, ...`` (unique
        across the engine's units)."""
        number(self.params, first)

    @property
    def gathered(self) -> bool:
        """Whether the whole buffer exists (filled, or being filled by an all-gather)."""
        return self.state in _WHOLE

    @property
    def freeable(self) -> bool:
        """Whether the schedule may free the unit now (gathered, neither pinned nor
        persistent)."""
        return self.state is ShardState.GATHERED

    def pin(self) -> None:
        """Keep the gathered unit whole until a matching ``unpin`` (persistent units are
        kept anyway)."""
        if self.state is ShardState.PERSISTENT:
            return
        if self.state is not ShardState.PINNED:
            self._move(ShardState.PINNED, "pin")
        self._pins += 1

    def unpin(self) -> None:
        """End one ``pin``; the last one leaves the unit gathered, for the schedule to free."""
        if self.state is ShardState.PERSISTENT:
            return
        invariant(self.state is ShardState.PINNED and self._pins > 0, "unpin without pin")
        self._pins -= 1
        if self._pins == 0:
            self._move(ShardState.GATHERED, "unpin")

    def make_persistent(self) -> None:
        """The gathered unit stays whole for the engine's life."""
        self._move(ShardState.PERSISTENT, "make persistent")

    def _arrived(self) -> None:
        self._move(ShardState.GATHERED, "gather completed")

    def place(self, placement: StatePlacement, unit_numel: int) -> None:
        """Give the permanent slice the storage ``placement`` decides (once, as the unit is
        built, after every view of the slice exists); ``unit_numel``: the unit's parameter
        elements."""
        self.slot = placement.param_shard(self.shard, unit_numel)
        invariant(self.slot.tensor is self.shard, "the slot must hold this rank's slice")

    @property
    def nbytes(self) -> int:
        """Bytes of the permanent storage (this rank's slice) in memory now."""
        return self.slot.resident_bytes

    def drop_shard(self) -> None:
        """Free a slice read back for a gather that has not happened (storage kept in a
        file only)."""
        if not self.gathered:
            self.slot.drop()

    def prefetch_shard(self) -> None:
        """Start reading the slice back ahead of its gather (storage kept in a file only)."""
        self.slot.prefetch()

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

    def unshard(self, label: str) -> CollectiveIO:
        """Make room for the whole buffer and point the parameters at it; returns the
        all-gather that fills it (their values are valid once that has completed)."""
        self._move(ShardState.GATHERING, "gather")
        self.slot.materialize()
        self.full.untyped_storage().resize_(self.full_nbytes)
        for param, view in zip(self.params, self._full_views, strict=True):
            param.data = view
        # Refilling the buffer is not a change autograd must see: views saved for backward
        # hold exactly these values again.
        return CollectiveIO(
            "all_gather", self.full, self.shard, "parameters", label, self._arrived, True
        )

    def refresh(self, label: str) -> CollectiveIO:
        """The all-gather of updated slices into the buffer already gathered (persistent
        units). It sends the shard itself: copying it into the buffer first would be one
        more copy per unit (a combined all-gather packs its inputs anyway)."""
        invariant(self.gathered, "refresh of a unit that is not gathered")
        return CollectiveIO("all_gather", self.full, self.shard, "parameters", label)

    def scatter_back(self) -> None:
        """Copy this rank's slice of the gathered buffer into permanent storage (after the
        whole buffer was changed the same way on every rank)."""
        invariant(self.gathered, "unit not gathered")
        lo, hi = self.owned
        self.shard.copy_(self.full[lo:hi])
        self.slot.write_back()

    def free(self) -> None:
        """Drop the gathered values; parameters become empty until the next gather."""
        self._move(ShardState.SHARDED, "free")
        for param in self.params:
            param.data = self._released
        self.full.untyped_storage().resize_(0)
        self.slot.drop()  # the slice is read back for the next gather

    def release(self) -> None:
        """Give every parameter its own full storage again (the unit must be gathered)."""
        invariant(self.state is not ShardState.GATHERING, "release while a gather is in flight")
        self._move(ShardState.DETACHED, "release")
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()
                param.grad = None
        self.full.untyped_storage().resize_(0)

    def detach(self) -> None:
        """Drop the gathered buffer, if any: the caller gives the parameters their own
        storage (from the master copy), and the unit is no longer the engine's."""
        invariant(self.state is not ShardState.GATHERING, "detach while a gather is in flight")
        self._move(ShardState.DETACHED, "detach")
        self.full.untyped_storage().resize_(0)
