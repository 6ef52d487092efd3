"""Shared-memory arena faults (issue 29, items 2, 3 and 8): a rank that dies while the
arena is set up leaves no segment; segments of dead creators are swept; a rank that dies,
turns zombie or is stopped is named within seconds, by its heartbeat rather than its
process id."""

from __future__ import annotations

import os
import signal
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from zerotrain.comm import shm
from zerotrain.comm.collectives import CollectiveError, Communicator
from zerotrain.testing.dist import DistributedTestError, run_distributed


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("zerotrain-*")}


def _dies_while_attaching() -> None:
    if int(os.environ["RANK"]) == 1:
        real = shm.ShmArena.__init__

        def die_on_open(self, name, rank, world_size, create, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not create:
                os._exit(7)  # the fault: this rank dies after the segment exists
            real(self, name, rank, world_size, create, *args, **kwargs)

        shm.ShmArena.__init__ = die_on_open  # type: ignore[method-assign]
    Communicator()


def test_a_rank_dying_during_the_arena_set_up_leaves_no_segment():
    before = _segments()
    with pytest.raises(DistributedTestError):
        run_distributed(_dies_while_attaching, 2, timeout=60, comm_timeout=10)
    assert _segments() - before == set()


def test_segments_of_dead_creators_are_swept():
    dead_pid = 2**22 + 12345  # above pid_max's default: no such process
    namespace = shm.process_tag().split(".")[1]
    name = shm.stale_sweepable_name(f"{dead_pid}.{namespace}", os.urandom(4).hex())
    elsewhere = shm.stale_sweepable_name(f"{dead_pid}.1", os.urandom(4).hex())
    old = time.time() - 3600
    for made in (name, elsewhere):
        segment = shared_memory.SharedMemory(name=made, create=True, size=4096)
        segment.close()
        os.utime(f"/dev/shm/{made}", (old, old))
    fresh = shm.segment_name()  # a live creator's (this process): kept
    kept = shared_memory.SharedMemory(name=fresh, create=True, size=4096)
    try:
        assert name in shm.remove_stale_segments()
        assert not Path(f"/dev/shm/{name}").exists()
        assert Path(f"/dev/shm/{fresh}").exists()
        # Another PID namespace's process ids mean nothing here: left alone.
        assert Path(f"/dev/shm/{elsewhere}").exists()
    finally:
        kept.close()
        kept.unlink()
        Path(f"/dev/shm/{elsewhere}").unlink(missing_ok=True)
