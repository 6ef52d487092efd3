"""Agreeing on a shared-memory arena for a process group (collective: every rank calls it).

Used by ``Communicator``'s constructor; the arena itself is ``shm.py``.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.comm import shm
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def open_group_arena(
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta | None,
    to_global: Callable[[int], int],
) -> shm.ShmCollectives | None:
    """Set up the arena if every rank is on this machine; every rank agrees or none uses
    it (a rank that fails to map the segment makes all of them fall back to gloo)."""
    # Each rank reads its own environment; the decision and the slot size must be the
    # same everywhere (different slot sizes would silently misplace data).
    try:
        slot_bytes, problem = shm.slot_bytes_from_env(), None
    except ValueError as err:
        slot_bytes, problem = 0, str(err)
    mine = (shm.host_identity(), shm.supported(), slot_bytes, problem)
    infos: list[tuple[str, bool, int, str | None] | None] = [None] * world_size
    dist.all_gather_object(infos, mine, group=group)
    seen = [info for info in infos if info is not None]
    problems = [f"rank {r}: {info[3]}" for r, info in enumerate(seen) if info[3]]
    if problems:
        raise ValueError("; ".join(problems))
    if len({info[0] for info in seen}) != 1 or not all(info[1] for info in seen):
        return None
    slot_bytes = seen[0][2]
    if len({info[2] for info in seen}) != 1:
        log.warning(
            "ZEROTRAIN_SHM_SLOT_BYTES differs between ranks; using rank 0's (%d)", slot_bytes
        )

    def open_arena(name: str, create: bool) -> shm.ShmArena | None:
        try:
            return shm.ShmArena(
                name,
                rank,
                world_size,
                create,
                timeout,
                slot_bytes,
            )
        except OSError as err:
            log.warning("rank %d: shared-memory collectives unavailable (%s)", rank, err)
            return None

    # Rank 0 creates the segment before anyone learns its name, so nobody opens too early.
    arena = open_arena(f"zerotrain-{uuid.uuid4().hex[:16]}", True) if rank == 0 else None
    names: list[str | None] = [arena.name if arena is not None else None]
    dist.broadcast_object_list(names, src=to_global(0), group=group)
    if rank != 0 and names[0] is not None:
        arena = open_arena(str(names[0]), False)
    ok = 1.0 if arena is not None else 0.0
    flag = torch.tensor([ok])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # also: all attached
    if rank == 0 and arena is not None:
        arena.unlink()  # the memory lives while mapped; no name is left behind
    if flag.item() < 1.0:
        if arena is not None:
            arena.close()
        return None
    return shm.ShmCollectives(arena)  # type: ignore[arg-type]
