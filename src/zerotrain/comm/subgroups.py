"""Communicators over parts of the job: one process group per group of a partition of ranks.

torch.distributed creates a group collectively (every rank of the job calls ``new_group``
for every group, members or not, in the same order), so a whole partition is created in one
call: each rank gets the communicator of the group it belongs to. Each communicator opens
its own shared-memory arena when all its ranks are on one host (``Communicator`` decides).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.local import LocalCommunicator

GROUP_DESC = "zerotrain:subgroup"


def _check_partition(partition: Sequence[Sequence[int]], world_size: int) -> None:
    seen = sorted(rank for group in partition for rank in group)
    if seen != list(range(world_size)):
        raise ValueError(
            f"the groups {[list(g) for g in partition]} must hold every rank 0..{world_size - 1} "
            "exactly once"
        )


def split(
    world: Communicator, partition: Sequence[Sequence[int]], *, dedicated: bool = False
) -> Communicator:
    """This rank's communicator among the groups of ``partition`` (collective over ``world``,
    which must be the default group: every rank calls it with the same partition).

    Args:
        world: the communicator of the whole job; the new ones take its timeout and device.
        partition: groups of global ranks; every rank in exactly one.
        dedicated: a process group of its own even when the partition is one group of
            every rank (point-to-point traffic that must not meet anyone else's messages).

    Returns:
        The communicator of the group holding this rank (``world`` itself when the partition
        is one group of every rank and not ``dedicated``; a :class:`LocalCommunicator`,
        without a process group, when every group is one rank). Its ranks are positions in
        that group, in the order the group lists them.

    Raises:
        ValueError: ``partition`` does not hold every rank exactly once.
    """
    _check_partition(partition, world.world_size)
    if len(partition) == 1 and not dedicated:
        return world
    if all(len(group) == 1 for group in partition):
        return LocalCommunicator(world.device, world.timeout)
    # The description names the groups as zerotrain's in torch's registry (and in NCCL's
    # logs); the test pool releases them with the engine that made them.
    mine, _ = dist.new_subgroups_by_enumeration(
        [list(group) for group in partition], timeout=world.timeout, group_desc=GROUP_DESC
    )
    return Communicator(mine, timeout=world.timeout, device=world.device)
