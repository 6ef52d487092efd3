"""One communicator per axis of the grid, built from a :class:`Topology`.

Every component gets the communicator of the axis it works along, explicitly: ZeRO shards
and reduces over ``zero`` (data x sequence), the data loader splits samples over ``data``,
pipeline stages exchange activations over ``pipe``, tensor-parallel layers reduce over
``tensor``, and job-wide agreement checks use ``world``. Nothing uses the default group
implicitly.

Groups with the same members share one communicator (with sequence 1, ``zero`` and
``data`` are the same object; with one axis spanning the job, that axis is ``world``), so
the plain data-parallel job still runs on exactly one communicator. The pipeline is the
exception: its point-to-point messages always get a group of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.stats import CollectiveCount, CommSnapshot
from zerotrain.comm.subgroups import split
from zerotrain.parallel.topology import DATA, PIPE, SEQUENCE, TENSOR, ZERO_AXES, Topology


@dataclass(frozen=True)
class ProcessGroups:
    """The communicators of one rank, one per axis of ``topology``.

    Attributes:
        topology: the grid.
        world: every rank of the job.
        zero: the ranks ZeRO shards over (data x sequence).
        data: data-parallel replicas (they read different samples).
        pipe: the stages of this rank's pipeline.
        tensor: this rank's tensor-parallel group.
        sequence: this rank's sequence-parallel group.
    """

    topology: Topology
    world: Communicator
    zero: Communicator
    data: Communicator
    pipe: Communicator
    tensor: Communicator
    sequence: Communicator

    @classmethod
    def build(cls, topology: Topology, world: Communicator) -> ProcessGroups:
        """Create the communicators (collective: every rank of ``world`` calls it with the
        same topology).

        Raises:
            ValueError: the topology does not have ``world``'s number of ranks.
        """
        if topology.world_size != world.world_size:
            raise ValueError(
                f"the topology {topology} has {topology.world_size} ranks, but the job has "
                f"{world.world_size}; the sizes of pipe x data x sequence x tensor must "
                "multiply to the number of processes"
            )
        made: dict[tuple[tuple[tuple[int, ...], ...], bool], Communicator] = {}

        def along(*axes: str, dedicated: bool = False) -> Communicator:
            partition = tuple(tuple(g) for g in topology.all_groups(axes))
            key = (partition, dedicated)
            if key not in made:
                made[key] = split(world, partition, dedicated=dedicated)
            return made[key]

        # Created in a fixed order on every rank: group creation is collective.
        return cls(
            topology=topology,
            world=world,
            zero=along(*ZERO_AXES),
            data=along(DATA),
            # The pipeline's messages get a group of their own even when it spans the job:
            # on the world's group they could meet a script's point-to-point calls (same
            # tags), or a failed earlier engine's messages still in flight.
            pipe=along(PIPE, dedicated=topology.pipe > 1),
            tensor=along(TENSOR),
            sequence=along(SEQUENCE),
        )

    def distinct(self) -> list[Communicator]:
        """Each communicator once (several axes may share one)."""
        seen: dict[int, Communicator] = {}
        for comm in (self.world, self.zero, self.data, self.pipe, self.tensor, self.sequence):
            seen.setdefault(id(comm), comm)
        return list(seen.values())

    def snapshot(self) -> CommSnapshot:
        """Collectives issued so far over every communicator, added up by (op, purpose)."""
        counts: dict[tuple[str, str], CollectiveCount] = {}
        for comm in self.distinct():
            for key, count in comm.snapshot().counts.items():
                counts[key] = counts.get(key, CollectiveCount()) + count
        return CommSnapshot(counts)

    def reset_stats(self) -> None:
        """Restart every communicator's counters."""
        for comm in self.distinct():
            comm.stats.reset()
