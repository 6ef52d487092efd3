"""n-D box and flat-range intersection (checkpoint/boxes.py) against element-by-element
enumeration: whole tensors, row and column blocks (tensor parallelism), ZeRO flat ranges
inside them, and random cases in 0 to 4 dimensions."""

from __future__ import annotations

import itertools
import random

import pytest

from zerotrain.checkpoint.boxes import Box, Region, Run, intersect, overlap, shared_count
from zerotrain.utils.invariant import InvariantError


def _elements(region: Region) -> dict[tuple[int, ...], int]:
    """Global index -> position in the region's data."""
    box = region.box
    found = {}
    for flat, local in enumerate(itertools.product(*(range(n) for n in box.lengths))):
        if region.lo <= flat < region.hi:
            found[tuple(o + i for o, i in zip(box.offsets, local, strict=False))] = flat - region.lo
    return found


def _expected(source: Region, target: Region) -> list[tuple[int, int]]:
    s, t = _elements(source), _elements(target)
    return sorted((s[g], t[g]) for g in s.keys() & t.keys())


def _expand(runs: list[Run]) -> list[tuple[int, int]]:
    return sorted((r.source + k, r.target + k) for r in runs for k in range(r.length))


def test_whole_tensors_are_one_run() -> None:
    shape = (50, 7, 3)
    assert overlap(Region.of(shape, 0, 1050), Region.of(shape, 0, 1050)) == [Run(0, 0, 1050)]
    # ZeRO ranges of a whole tensor: one run each, clipped to both.
    assert overlap(Region.of(shape, 100, 600), Region.of(shape, 400, 900)) == [Run(300, 0, 200)]
    assert overlap(Region.of(shape, 0, 100), Region.of(shape, 100, 200)) == []


def test_zero_dimensional_tensors() -> None:
    assert overlap(Region.of((), 0, 1), Region.of((), 0, 1)) == [Run(0, 0, 1)]
    assert Box.whole(()).numel == 1


def test_column_blocks_meet_in_one_strided_run_per_row() -> None:
    # A (4, 6) weight saved as two column blocks (tensor parallel 2), loaded as three.
    saved = Region(Box((0, 3), (4, 3)), 0, 12)
    wanted = Region(Box((0, 2), (4, 2)), 0, 8)  # columns 2-3
    runs = overlap(saved, wanted)
    assert runs == [Run(r * 3, r * 2 + 1, 1) for r in range(4)]  # column 3 of each row
    assert _expand(runs) == _expected(saved, wanted)


def test_row_blocks_are_contiguous() -> None:
    saved = Region(Box((2, 0), (4, 5)), 0, 20)
    wanted = Region(Box((0, 0), (4, 5)), 0, 20)
    assert overlap(saved, wanted) == [Run(0, 10, 10)]  # rows 2-3 in one run


def test_zero_flat_range_inside_a_tensor_parallel_block() -> None:
    # Rank holds columns 4-7 of an (8, 8) weight; ZeRO owns elements 5..21 of that block,
    # starting and ending mid-row. The loader wants columns 2-5 of rows 1-6, whole.
    saved = Region(Box((0, 4), (8, 4)), 5, 21)
    wanted = Region(Box((1, 2), (6, 4)), 0, 24)
    assert _expand(overlap(saved, wanted)) == _expected(saved, wanted)
    assert shared_count(saved, wanted) == len(_expected(saved, wanted)) > 0


def test_disjoint_boxes_share_nothing() -> None:
    assert intersect(Box((0, 0), (2, 2)), Box((2, 0), (2, 2))) is None
    assert overlap(Region(Box((0,), (4,)), 0, 4), Region(Box((4,), (4,)), 0, 4)) == []


@pytest.mark.parametrize("seed", range(300))
def test_random_regions_match_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    ndim = rng.randint(0, 4)
    shape = tuple(rng.randint(1, 5) for _ in range(ndim))

    def region() -> Region:
        offsets, lengths = [], []
        for s in shape:
            a = rng.randint(0, s - 1)
            offsets.append(a)
            lengths.append(rng.randint(1, s - a))
        box = Box(tuple(offsets), tuple(lengths))
        lo = rng.randint(0, box.numel)
        return Region(box, lo, rng.randint(lo, box.numel))

    source, target = region(), region()
    runs = overlap(source, target)
    assert _expand(runs) == _expected(source, target)
    # Runs are in target order, maximal (adjacent ones merged) and non-empty.
    assert all(r.length > 0 for r in runs)
    for a, b in itertools.pairwise(runs):
        assert a.target + a.length <= b.target
        assert not (a.source + a.length == b.source and a.target + a.length == b.target)


def test_malformed_boxes_and_ranges_are_refused() -> None:
    with pytest.raises(InvariantError, match="offset and length per dimension"):
        Box((0,), (1, 2))
    with pytest.raises(InvariantError, match="outside a box of 6 elements"):
        Region(Box((0, 0), (2, 3)), 2, 7)
    assert not Box((1, 0), (2, 3)).inside((2, 3))
