"""The rank grid, without processes."""

from __future__ import annotations

import itertools

import pytest

from zerotrain.parallel import AXES, ZERO_AXES, Coordinates, Topology


def test_megatron_8_rank_example() -> None:
    # Megatron-LM's initialize_model_parallel docstring: 8 GPUs, tensor 2, pipeline 2.
    topo = Topology(pipe=2, data=2, tensor=2)
    assert topo.all_groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.all_groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.all_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.coordinates(5) == Coordinates(pipe=1, data=0, sequence=0, tensor=1)
    assert str(topo) == "pipe=2 x data=2 x sequence=1 x tensor=2"


SHAPES = list(itertools.product([1, 2, 3], repeat=4))


@pytest.mark.parametrize(("pipe", "data", "sequence", "tensor"), SHAPES)
def test_ranks_and_coordinates_round_trip_and_groups_partition(
    pipe: int, data: int, sequence: int, tensor: int
) -> None:
    topo = Topology(pipe=pipe, data=data, tensor=tensor, sequence=sequence)
    assert topo.world_size == pipe * data * sequence * tensor
    seen = set()
    for rank in range(topo.world_size):
        c = topo.coordinates(rank)
        assert topo.rank(pipe=c.pipe, data=c.data, sequence=c.sequence, tensor=c.tensor) == rank
        seen.add((c.pipe, c.data, c.sequence, c.tensor))
    assert len(seen) == topo.world_size
    for r in range(1, len(AXES) + 1):
        for axes in itertools.combinations(AXES, r):
            groups = topo.all_groups(axes)
            assert sorted(itertools.chain(*groups)) == list(range(topo.world_size))
            assert all(len(g) == topo.size(axes) for g in groups)
            for group in groups:
                # Members differ only along `axes`.
                others = {
                    tuple(topo.coordinates(m).get(a) for a in AXES if a not in axes) for m in group
                }
                assert len(others) == 1
    # A combined group is the union of its axes' groups through each member.
    for rank in range(topo.world_size):
        combined = set(topo.group_ranks(ZERO_AXES, rank))
        assert combined == {
            s for d in topo.group_ranks("data", rank) for s in topo.group_ranks("sequence", d)
        }


def test_tensor_varies_fastest_by_default_and_order_can_change() -> None:
    topo = Topology(pipe=2, data=2, tensor=4)
    assert topo.group_ranks("tensor", 5) == [4, 5, 6, 7]
    assert topo.group_ranks("pipe", 5) == [5, 13]
    flipped = Topology(pipe=2, data=2, tensor=4, order=("tensor", "sequence", "data", "pipe"))
    assert flipped.group_ranks("pipe", 0) == [0, 1]
    assert flipped.group_ranks("tensor", 0) == [0, 4, 8, 12]


def test_pipeline_neighbours() -> None:
    topo = Topology(pipe=3, data=2)
    assert topo.stage_neighbour(1, +1) == 3
    assert topo.stage_neighbour(3, -1) == 1
    assert topo.stage_neighbour(5, +1) is None
    assert topo.stage_neighbour(0, -1) is None
    assert topo.is_first_stage(1)
    assert topo.is_last_stage(5)
    assert not topo.is_last_stage(3)


def test_from_world_infers_data() -> None:
    assert Topology.from_world(8, pipe=2, tensor=2) == Topology(pipe=2, data=2, tensor=2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pipe 2 x tensor 2"):
        Topology.from_world(6, pipe=2, tensor=2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Topology(data=0), r"data=0; each size must be an integer >= 1"),
        (lambda: Topology(tensor=1.5), r"tensor=1.5; each size must be an integer >= 1"),
        (lambda: Topology(order=("pipe", "data", "tensor")), "must name each of"),
        (lambda: Topology(data=2).coordinates(2), r"rank 2 is outside the grid .*\(0..1\)"),
        (lambda: Topology(data=2).rank(data=2), r"data=2 is outside the grid"),
        (lambda: Topology().group_ranks("model", 0), r"unknown parallel axis 'model'"),
        (lambda: Topology().all_groups(("data", "data")), "name an axis twice"),
    ],
)
def test_bad_input_is_named(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
