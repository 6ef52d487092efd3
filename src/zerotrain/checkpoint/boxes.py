"""Where a piece of a tensor sits in the global tensor, and which elements two pieces share.

A checkpoint addresses data the way PyTorch's Distributed Checkpoint does: a rank's tensor is
a *box* of the global tensor (per-dimension offsets and lengths: the whole tensor today, a
row or column block under tensor parallelism), and ZeRO owns a *flat range* of that box's
row-major flattening. A :class:`Region` is the two together. Loading into another layout is
:func:`overlap` of each saved region with each wanted one: runs of elements contiguous in
both, found dimension by dimension without enumerating elements. Pure functions: no torch,
no processes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from zerotrain.utils.invariant import invariant


@dataclass(frozen=True, slots=True)
class Box:
    """The elements ``offsets[d] <= i[d] < offsets[d] + lengths[d]`` of a global tensor."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        invariant(
            len(self.offsets) == len(self.lengths)
            and all(o >= 0 for o in self.offsets)
            and all(n >= 0 for n in self.lengths),
            f"a box needs one non-negative offset and length per dimension, got {self}",
        )

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        """The box covering a tensor of ``shape`` entirely."""
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d box)."""
        return math.prod(self.lengths)

    def strides(self) -> tuple[int, ...]:
        """Row-major strides of the box's own flattening."""
        strides, step = [], 1
        for n in reversed(self.lengths):
            strides.append(step)
            step *= n
        return tuple(reversed(strides))

    def inside(self, shape: tuple[int, ...]) -> bool:
        """Whether the box lies within a tensor of ``shape``."""
        return len(shape) == len(self.offsets) and all(
            o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape, strict=True)
        )


def intersect(a: Box, b: Box) -> Box | None:
    """The elements in both boxes, or None when they share none."""
    invariant(len(a.offsets) == len(b.offsets), f"boxes of different rank: {a}, {b}")
    offsets, lengths = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


@dataclass(frozen=True, slots=True)
class Region:
    """Elements ``[lo, hi)`` of ``box``'s row-major flattening: what one stored (or wanted)
    piece of a tensor holds. ``lo=0, hi=box.numel`` is the whole box."""

    box: Box
    lo: int
    hi: int

    def __post_init__(self) -> None:
        invariant(
            0 <= self.lo <= self.hi <= self.box.numel,
            f"flat range [{self.lo}, {self.hi}) outside a box of {self.box.numel} elements",
        )

    @staticmethod
    def of(shape: tuple[int, ...], lo: int, hi: int) -> Region:
        """Elements ``[lo, hi)`` of the flattened whole tensor of ``shape``."""
        return Region(Box.whole(shape), lo, hi)

    @property
    def numel(self) -> int:
        """Number of elements held."""
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class Run:
    """``length`` elements at position ``source`` of the source region's data (counted from
    its ``lo``) are the elements at position ``target`` of the target region's data."""

    source: int
    target: int
    length: int


def overlap(source: Region, target: Region) -> list[Run]:
    """The elements ``source`` and ``target`` share, as runs contiguous in both, in the
    target's order. Both boxes must be of the same global tensor."""
    common = intersect(source.box, target.box)
    if common is None or source.lo >= source.hi or target.lo >= target.hi:
        return []
    ndim = len(common.lengths)
    # Trailing dimensions that all three boxes span entirely are contiguous in both
    # flattenings, and so is the one dimension just before them: one chunk per index of the
    # dimensions in front (a whole-tensor box is a single chunk).
    full = ndim
    while full > 0 and (
        common.lengths[full - 1] == source.box.lengths[full - 1] == target.box.lengths[full - 1]
    ):
        full -= 1
    split = max(full - 1, 0)
    chunk = math.prod(common.lengths[split:])
    s_strides, t_strides = source.box.strides(), target.box.strides()
    runs: list[Run] = []
    for index in itertools.product(*(range(n) for n in common.lengths[:split])):
        point = [o + i for o, i in zip(common.offsets, index, strict=False)]
        point += list(common.offsets[split:])
        s_start = sum(
            (p - o) * st for p, o, st in zip(point, source.box.offsets, s_strides, strict=True)
        )
        t_start = sum(
            (p - o) * st for p, o, st in zip(point, target.box.offsets, t_strides, strict=True)
        )
        a = max(0, source.lo - s_start, target.lo - t_start)
        b = min(chunk, source.hi - s_start, target.hi - t_start)
        if a >= b:
            continue
        run = Run(s_start + a - source.lo, t_start + a - target.lo, b - a)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.source + last.length == run.source
            and last.target + last.length == run.target
        ):
            runs[-1] = Run(last.source, last.target, last.length + run.length)
        else:
            runs.append(run)
    return runs


def shared_count(source: Region, target: Region) -> int:
    """How many elements ``source`` and ``target`` share."""
    return sum(run.length for run in overlap(source, target))
