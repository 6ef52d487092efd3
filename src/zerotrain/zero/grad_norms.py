"""The global gradient norm of a ZeRO strategy's units, and what it counts.

Every rank holds some of the gradient's elements: its reduced slices (stages 1-3, summed
over the ZeRO group), and along distinct axes of a grid (tensor parallelism, pipeline
stages) different parameters altogether. The global norm adds each element's square once:
units another rank along a distinct axis also holds are left out here (a pipeline stage's
copy of a tied embedding), parameters whole on every tensor-parallel rank are counted on
one of them. One composable reducer sums the partial squares over the ZeRO group and each
distinct axis, so clipping and the inf/NaN decision agree on every rank of the grid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.optim.clip import norm_from_squares
from zerotrain.shard.storage import ResidentSlot
from zerotrain.shard.unit import ShardedUnit
from zerotrain.utils.norms import shard_squared_norms, squared_norm, squared_norms, sum_squares


class GradNorms:
    """Norms of ``units``' reduced gradients.

    Args:
        units: the strategy's units, in order.
        comm: the ZeRO group.
        sharded: gradients are sharded over ``comm`` (stages 1-3).
        distinct_axes: grid axes whose ranks hold different gradient elements.
    """

    def __init__(
        self,
        units: Sequence[ShardedUnit],
        comm: Communicator,
        sharded: bool,
        distinct_axes: Sequence[Communicator],
    ) -> None:
        self.units = list(units)
        self.comm = comm
        self.sharded = sharded
        self.distinct_axes = tuple(distinct_axes)
        # Units whose gradients another rank of a distinct axis also holds (a pipeline
        # stage's copy of a tied embedding): left out of the global norm, counted once.
        self._norm_excluded: set[int] = set()
        # Per unit with elements another rank along a distinct axis counts (parameters whole
        # on every tensor-parallel rank, counted on the group's first rank only): the
        # ranges of its owned gradient slice this rank counts in the global norm.
        self._norm_ranges: dict[int, list[tuple[int, int]]] = {}
        # This rank's (unit, sum of squares) behind the last global norm: a step whose
        # verdict is read later names the first unit that held inf/NaN from these.
        self.last_squares: list[tuple[int, torch.Tensor]] = []

    def _sum_across_shards(self, tensor: torch.Tensor) -> None:
        self.comm.all_reduce(tensor, purpose="control")

    def _sum_across_grid(self, tensor: torch.Tensor) -> None:
        if self.sharded:
            self._sum_across_shards(tensor)
        for axis in self.distinct_axes:
            axis.all_reduce(tensor, purpose="control")

    def shard_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """Sums partial squared norms of *one parameter* over the ranks it is split across
        (per-parameter norms: LAMB's trust ratios), or None when parameters are whole."""
        return self._sum_across_shards if self.sharded else None

    def global_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """Sums partial squared norms over every rank that holds distinct gradient elements:
        the ZeRO group when gradients are sharded, then each of ``distinct_axes``. One
        composable reducer, so clipping and the fp16 overflow decision (a non-finite norm)
        agree on every rank of the grid. None when this rank holds every element."""
        if not self.sharded and not self.distinct_axes:
            return None
        return self._sum_across_grid

    def global_norm(self, local: bool = False) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (0-d fp32; one all-reduce per axis that
        holds distinct elements). Gradient slices in swap files contribute the sums taken
        as they were written. ``local``: each rank holds its own, unaveraged gradients
        (``_local_norm``)."""
        for unit in self.units:
            unit.check_reduced()
        if local:
            return self._local_norm()
        counted = [k for k in range(len(self.units)) if k not in self._norm_excluded]
        # Slices resident for good are read together (one foreach norm for the short ones);
        # the others report what their storage recorded.
        together = [
            k
            for k in counted
            if k not in self._norm_ranges and isinstance(self.units[k].grads.slot, ResidentSlot)
        ]
        shards = [self.units[k].grad_shard for k in together]
        by_unit = dict(zip(together, shard_squared_norms(shards), strict=True))
        squares = [
            by_unit[k]
            if k in by_unit
            else self._counted_squares(k, self.units[k])
            if k in self._norm_ranges
            else self.units[k].grad_squared_norm()
            for k in counted
        ]
        self.last_squares = list(zip(counted, squares, strict=True))
        return norm_from_squares(squares, self.global_reducer())

    def _local_norm(self) -> torch.Tensor:
        """With each rank's own gradients: the quadratic mean of their norms over the ranks,
        ``sqrt(mean_r ||g_r||^2)`` (one scalar all-reduce). It bounds the norm of their
        average, so clipping by it never lets a step grow past what clipping the averaged
        gradient would allow; and one inf/NaN on any rank makes it non-finite everywhere."""

        def mean_over_ranks(total: torch.Tensor) -> None:
            self.comm.all_reduce(total, purpose="control")
            total.div_(self.comm.world_size)

        squares = [squared_norm(u.grads.flat) for u in self.units]  # type: ignore[union-attr]
        self.last_squares = list(enumerate(squares))
        return norm_from_squares(squares, mean_over_ranks)

    def first_nonfinite(self) -> str | None:
        """The first parameter, in unit order, whose reduced gradient holds inf/NaN in this
        rank's slices (None: none here; another rank's slices may hold it)."""
        return next((n for u in self.units if (n := u.first_nonfinite_grad()) is not None), None)

    def first_nonfinite_unit(self, squares: list[tuple[int, torch.Tensor]]) -> str | None:
        """From the per-unit sums of squares of a past step (``last_squares``, taken
        before its gradients were cleared): the first unit whose slice on this rank held
        inf/NaN, described by the parameters in that slice (None: none here)."""
        if not squares:
            return None
        finite = torch.isfinite(torch.stack([square for _, square in squares])).tolist()
        k = next((k for (k, _), ok in zip(squares, finite, strict=True) if not ok), None)
        if k is None:
            return None
        unit = self.units[k]
        lo, hi = unit.owned
        names = [p.fqn for p in unit.buffer.layout.params if p.start < hi and p.end > lo]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        return f"one of {shown} (unit '{unit.label}')"

    def _counted_squares(self, k: int, unit: ShardedUnit) -> torch.Tensor:
        if unit.grads.slot.streamed:
            raise NotImplementedError(
                f"{unit!r}: the global gradient norm of a unit holding both split and whole "
                "tensor-parallel parameters needs its gradient in memory, but it is kept in "
                "a swap file (NVMe offload); offload to the CPU instead"
            )
        grad = unit.grad_shard
        parts = [grad[a:b] for a, b in self._norm_ranges[k]]
        return (
            sum_squares(squared_norms(parts)) if parts else grad.new_zeros((), dtype=torch.float64)
        )

    def count_once_elsewhere(self, params: Iterable[torch.Tensor]) -> None:
        """Leave ``params``'s gradient elements out of :meth:`global_norm` on this rank:
        they are whole on every rank of a distinct axis (a LayerNorm under tensor
        parallelism) and another rank counts them."""
        ids = {id(p) for p in params}
        for k, unit in enumerate(self.units):
            lo, hi = unit.owned
            skipped = []
            for param, spec in zip(unit.buffer.params, unit.buffer.layout.params, strict=True):
                a, b = max(lo, spec.start), min(hi, spec.end)
                if id(param) in ids and a < b:
                    skipped.append((a - lo, b - lo))
            if not skipped:
                continue
            counted, at = [], 0
            for a, b in sorted(skipped):
                if a > at:
                    counted.append((at, a))
                at = max(at, b)
            if at < hi - lo:
                counted.append((at, hi - lo))
            self._norm_ranges[k] = counted

    def exclude(self, units: Iterable[int]) -> None:
        """Leave ``units`` out of :meth:`global_norm` on this rank: another rank along a
        distinct axis holds the same gradients and counts them."""
        self._norm_excluded.update(units)
