"""Where the engine's process sits in the job: global rank and its place on each axis."""

from __future__ import annotations

from zerotrain.comm.env import DistEnv
from zerotrain.parallel.groups import ProcessGroups
from zerotrain.parallel.topology import Coordinates, Topology


class RankQueries:
    """Rank accessors with DeepSpeed's names: ``global_rank`` and ``world_size`` count every
    process of the job; ``dp_rank`` and ``dp_world_size`` the data-parallel group ZeRO
    shards over (data x sequence); ``pp_rank``, ``tp_rank`` and ``sp_rank`` the place on the
    other axes."""

    env: DistEnv
    groups: ProcessGroups
    topology: Topology

    @property
    def coordinates(self) -> Coordinates:
        """This process's coordinates in the grid."""
        return self.topology.coordinates(self.env.rank)

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the whole job."""
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        """This process's rank in its data-parallel (ZeRO) group."""
        return self.groups.zero.rank

    @property
    def dp_world_size(self) -> int:
        """Number of ranks in the data-parallel (ZeRO) group."""
        return self.groups.zero.world_size

    @property
    def pp_rank(self) -> int:
        """This process's pipeline stage."""
        return self.coordinates.pipe

    @property
    def tp_rank(self) -> int:
        """This process's rank in its tensor-parallel group."""
        return self.coordinates.tensor

    @property
    def sp_rank(self) -> int:
        """This process's rank in its sequence-parallel group."""
        return self.coordinates.sequence

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.env.local_rank
