"""Agreeing on shared memory for a process group (collective: every rank calls it).

Used by ``Communicator``'s constructor: the arena for collectives (``shm.py``) when every
rank is on this machine, and the point-to-point channels (``shm_p2p.py``) for the peers that
are. Both are agreed on in the one gather the arena already needed; channels are created
only when a pair first exchanges a message.
"""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerotrain.comm import liveness, shm
from zerotrain.comm.shm_p2p import PairSettings, ShmPairs
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


# host, shm supported, slot bytes, problems, pid, token, pair settings, process tag
_Info = tuple[str, bool, int, str | None, int, str, PairSettings | None, str]


def open_group_arena(
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta | None,
    to_global: Callable[[int], int],
) -> tuple[shm.ShmCollectives | None, ShmPairs | None]:
    """Set up the arena if every rank is on this machine; every rank agrees or none uses
    it (a rank that fails to map the segment makes all of them fall back to gloo). Also
    returns the point-to-point channels when some peer shares this machine."""
    # Each rank reads its own environment; the decision and the sizes must be the same
    # everywhere (different slot sizes would silently misplace data).
    problems: list[str] = []
    try:
        slot_bytes = shm.slot_bytes_from_env()
    except ValueError as err:
        slot_bytes = 0
        problems.append(str(err))
    try:
        pair_settings: PairSettings | None = PairSettings.from_env()
    except ValueError as err:
        pair_settings = None
        problems.append(str(err))
    mine: _Info = (
        shm.host_identity(),
        shm.supported(),
        slot_bytes,
        "; ".join(problems) or None,
        os.getpid(),
        uuid.uuid4().hex[:16],
        pair_settings,
        liveness.process_tag(),
    )
    infos: list[_Info | None] = [None] * world_size
    dist.all_gather_object(infos, mine, group=group)
    seen = [info for info in infos if info is not None]
    invariant(len(seen) == world_size, "shared-memory set-up: a rank sent nothing")
    errors = [f"rank {r}: {info[3]}" for r, info in enumerate(seen) if info[3]]
    if errors:
        raise ValueError("; ".join(errors))
    pairs = _pairs(seen, rank, timeout)
    if len({info[0] for info in seen}) != 1 or not all(info[1] for info in seen):
        return None, pairs
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
                global_ranks=[to_global(r) for r in range(world_size)],
            )
        except OSError as err:
            log.warning("rank %d: shared-memory collectives unavailable (%s)", rank, err)
            return None

    # Rank 0 creates the segment before anyone learns its name, so nobody opens too early.
    arena = None
    if rank == 0:
        shm.remove_stale_segments()
        arena = open_arena(shm.segment_name(), True)
    try:
        names: list[str | None] = [arena.name if arena is not None else None]
        dist.broadcast_object_list(names, src=to_global(0), group=group)
        if rank != 0 and names[0] is not None:
            arena = open_arena(str(names[0]), False)
        ok = 1.0 if arena is not None else 0.0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # also: all attached
    finally:
        # The memory lives while mapped; no name is left behind, also when a rank died
        # during the set-up (the exchange above then raised on this rank).
        if rank == 0 and arena is not None:
            arena.unlink()
    if flag.item() < 1.0:
        if arena is not None:
            arena.close()
        return None, pairs
    return shm.ShmCollectives(arena), pairs  # type: ignore[arg-type]


def _pairs(seen: list[_Info], rank: int, timeout: datetime.timedelta | None) -> ShmPairs | None:
    """Point-to-point channels with the ranks on this machine (rank 0's token and settings;
    none at all where this rank or every peer cannot use shared memory)."""
    host, supported = seen[rank][0], seen[rank][1]
    local = [r != rank and supported and info[1] and info[0] == host for r, info in enumerate(seen)]
    settings = seen[0][6]
    if not any(local) or settings is None:
        return None
    if len({info[6] for info in seen}) != 1:
        log.warning("the shared-memory p2p settings differ between ranks; using rank 0's")
    return ShmPairs(
        rank=rank,
        world_size=len(seen),
        token=seen[0][5],
        pids=[info[4] for info in seen],
        tags=[info[7] for info in seen],
        local=local,
        settings=settings,
        timeout=(timeout or datetime.timedelta(seconds=600)).total_seconds(),
    )
