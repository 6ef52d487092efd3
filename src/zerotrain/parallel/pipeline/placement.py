"""Which pipeline stage this process builds: from ``stage_id``, or from its rank in the grid."""

from __future__ import annotations

from zerotrain.comm.env import current_rank_and_world
from zerotrain.parallel.topology import Topology


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"PipelineModule: {name}={value!r}; must be an integer >= 1")
    return value


def resolve_placement(
    num_stages: int | None, topology: Topology | None, stage_id: int | None
) -> tuple[int, Topology | None, int]:
    """``(num_stages, topology, stage)`` for a ``PipelineModule``.

    ``num_stages`` and ``topology.pipe`` must agree when both are given. Without
    ``stage_id``, the stage is this process's pipe coordinate: in ``topology``, or in
    ``Topology.from_world(world, pipe=num_stages)``; a process without a process group is
    rank 0 of 1.

    Raises:
        ValueError: neither count given, counts that disagree, a stage outside them, or a
            grid that does not match the process group.
        TypeError: a ``topology`` that is not a ``Topology``.
    """
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(
            f"PipelineModule: topology must be a zerotrain.parallel.Topology, got {topology!r}"
        )
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule needs num_stages= or topology= (the pipeline degree)")
    if num_stages is not None:
        num_stages = _positive("num_stages", num_stages)
        if topology is not None and topology.pipe != num_stages:
            raise ValueError(
                f"PipelineModule: num_stages={num_stages} but topology {topology} has pipe="
                f"{topology.pipe}; give one of them, or both equal"
            )
    stages = topology.pipe if topology is not None else num_stages
    if stages is None:  # unreachable: one of the two is set; keeps the type narrow
        raise ValueError("PipelineModule needs num_stages= or topology=")
    if stage_id is not None:
        if isinstance(stage_id, bool) or not isinstance(stage_id, int):
            raise ValueError(f"PipelineModule: stage_id={stage_id!r}; must be an integer")
        if not 0 <= stage_id < stages:
            raise ValueError(f"PipelineModule: stage_id={stage_id}; the stages are 0..{stages - 1}")
        return stages, topology, stage_id
    rank, world = current_rank_and_world()
    if topology is None:
        try:
            topology = Topology.from_world(world, pipe=stages)
        except ValueError as err:
            raise ValueError(
                f"PipelineModule(num_stages={stages}) in a job of {world} process(es): {err}; "
                "without a process group, pass stage_id= to build one stage"
            ) from None
    elif topology.world_size != world:
        raise ValueError(
            f"PipelineModule: topology {topology} has {topology.world_size} ranks but the job "
            f"has {world} process(es); without a process group, pass stage_id= to build one "
            "stage"
        )
    return stages, topology, topology.coordinates(rank).pipe
