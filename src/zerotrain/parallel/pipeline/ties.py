"""Tied weights across pipeline stages (an embedding shared with the output head).

Each stage that holds a layer of a tie key keeps its own copy of the tied module. The copies
start equal (the lowest stage's values are broadcast at initialize) and stay equal: after
every step's backward the copies' gradients are summed among the stages that hold them, so
every copy takes the same optimizer step, as DeepSpeed does.

With ZeRO the sum runs on the *reduced* gradient slices rather than before the data-parallel
reduction: both are sums, over different axes, so the order does not change the result, and
summing slices moves 1/D of the bytes. For the slices to line up element for element, each
stage keeps the tied module's parameters in a unit of their own (stages 0-2: ``isolate``;
stage 3: the stage module names the tied module as a unit), laid out alike on every stage.
The global gradient norm counts the tied gradient once: the copies other than the lowest
stage's are left out of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.subgroups import split
from zerotrain.parallel.topology import PIPE, Topology
from zerotrain.utils.invariant import InvariantError

TIED_PREFIX = "tied_modules."


@dataclass(frozen=True)
class TiedGroup:
    """The stages holding one tie key, as seen from one rank that holds it.

    Attributes:
        key: the tie key.
        comm: this rank and the ranks of the other stages holding the key (same
            data/sequence/tensor coordinates), lowest stage first.
        owner: whether this rank is the lowest stage holding the key (its copy counts in
            the gradient norm, and its values are the initial ones).
    """

    key: str
    comm: Communicator
    owner: bool

    @property
    def prefix(self) -> str:
        """Parameter names of the tied module start with this."""
        return f"{TIED_PREFIX}{self.key}."


def build_tied_groups(
    world: Communicator, topology: Topology, stages_of_key: Mapping[str, Sequence[int]]
) -> list[TiedGroup]:
    """One group per tie key held by more than one pipeline rank (collective over
    ``world``: every rank calls it with the same arguments; keys in sorted order, so any
    order of keys in the layer list agrees on every rank). Returns the groups this rank is
    in.

    Args:
        stages_of_key: for each key, the pipeline ranks (pipe coordinates) holding it.
    """
    me = topology.coordinates(world.rank)
    mine = []
    for key in sorted(stages_of_key):
        holders = sorted(set(stages_of_key[key]))
        if len(holders) < 2:
            continue
        partition: list[list[int]] = []
        placed: set[int] = set()
        for rank in range(topology.world_size):
            if rank in placed:
                continue
            pipe_peers = topology.group_ranks(PIPE, rank)  # this rank's pipeline, by stage
            if topology.coordinates(rank).pipe in holders:
                group = [pipe_peers[s] for s in holders]
            else:
                group = [rank]
            partition.append(group)
            placed.update(group)
        comm = split(world, partition)
        if me.pipe in holders:
            mine.append(TiedGroup(key, comm, owner=me.pipe == holders[0]))
    return mine


def broadcast_initial(groups: Sequence[TiedGroup], params: dict[str, list[torch.Tensor]]) -> None:
    """Give every copy of each tied module the lowest stage's values."""
    with torch.no_grad():
        for group in groups:
            for tensor in params[group.key]:
                group.comm.broadcast(tensor, src=0, purpose="parameters")


def sum_gradient_slices(groups: Sequence[TiedGroup], slices: dict[str, list[torch.Tensor]]) -> None:
    """Sum each tied module's reduced gradient slices over the stages holding it."""
    for group in groups:
        tensors = slices.get(group.key)
        if not tensors:
            raise InvariantError(f"no gradient unit holds the tied module '{group.key}'")
        for tensor in tensors:
            group.comm.all_reduce(tensor, purpose="gradients", label=f"tied {group.key}")
