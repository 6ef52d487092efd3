"""Flat-buffer offset arithmetic, checked exhaustively for small cases."""

from __future__ import annotations

import pytest

from zerotrain.shard.layout import FlatLayout

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", (2, 2, 2)), ("d", (1,))]  # 31 elements


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("align", [1, 4])
def test_fragments_cover_every_element_exactly_once(world_size, align):
    layout = FlatLayout.pack(SHAPES, world_size=world_size, align=align)
    assert layout.numel == 31
    assert layout.padded_numel % (world_size * align) == 0
    assert layout.padded_numel - layout.numel < world_size * align
    covered = {name: [0] * layout.params[i].numel for i, (name, _) in enumerate(SHAPES)}
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        for frag in layout.fragments(rank):
            spec = next(s for s in layout.params if s.fqn == frag.fqn)
            # The fragment's place in the shard matches its place in the flat buffer.
            assert lo + frag.local_offset == spec.start + frag.lo
            assert frag.local_offset >= 0
            assert frag.local_offset + frag.numel <= layout.shard_numel
            for k in range(frag.lo, frag.hi):
                covered[frag.fqn][k] += 1
    assert all(count == 1 for counts in covered.values() for count in counts)


def test_pack_places_parameters_back_to_back():
    layout = FlatLayout.pack(SHAPES)
    assert [(s.start, s.end) for s in layout.params] == [(0, 15), (15, 22), (22, 30), (30, 31)]


def test_invalid_layouts_are_rejected():
    with pytest.raises(ValueError, match="world_size and align"):
        FlatLayout.pack(SHAPES, world_size=0)
    layout = FlatLayout.pack(SHAPES, world_size=2)
    with pytest.raises(ValueError, match="outside world size"):
        layout.shard_range(2)
    with pytest.raises(ValueError, match="starts at"):
        FlatLayout((layout.params[1],))
