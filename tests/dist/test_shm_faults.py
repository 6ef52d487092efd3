"""Shared-memory arena faults (issue 29, items 2, 3 and 8): a rank that dies while the
arena is set up leaves no segment; segments of dead creators are swept; a rank that dies,
turns zombie or is stopped is named within seconds, by its heartbeat rather than its
process id."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from zerotrain.comm import liveness, shm
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
    namespace = liveness.process_tag().split(".")[1]
    name = shm.stale_sweepable_name(f"{dead_pid}.{namespace}", os.urandom(4).hex())
    elsewhere = shm.stale_sweepable_name(f"{dead_pid}.1", os.urandom(4).hex())
    old = time.time() - 3600
    for made in (name, elsewhere):
        segment = shm.untracked_segment(made, True, 4096)
        segment.close()
        os.utime(f"/dev/shm/{made}", (old, old))
    fresh = shm.segment_name()  # a live creator's (this process): kept
    kept = shm.untracked_segment(fresh, True, 4096)
    try:
        assert name in shm.remove_stale_segments()
        assert not Path(f"/dev/shm/{name}").exists()
        assert Path(f"/dev/shm/{fresh}").exists()
        # Another PID namespace's process ids mean nothing here: left alone.
        assert Path(f"/dev/shm/{elsewhere}").exists()
    finally:
        kept.close()
        Path(f"/dev/shm/{fresh}").unlink(missing_ok=True)
        Path(f"/dev/shm/{elsewhere}").unlink(missing_ok=True)


def _peer_fails(how: str) -> None:
    """Rank 1 stops (SIGSTOP) or dies (os._exit) just before an all-reduce; rank 0 reports
    what it saw and after how long."""
    comm = Communicator()
    comm.barrier()
    if comm.rank == 1:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(9)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000), purpose="gradients")
    except CollectiveError as err:
        raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {err}") from None


def _detected(how: str, env: dict[str, str], comm_timeout: float = 40) -> tuple[float, str]:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_peer_fails, 2, how, timeout=90, comm_timeout=comm_timeout, env=env)
    message = str(info.value)
    rank0 = message.split("RuntimeError: after ")[1]
    seconds = float(rank0.split(" s:")[0])
    print(f"{how} ({env}): detected after {seconds:.1f} s: {rank0.splitlines()[0][:300]}")
    return seconds, rank0


def test_a_stopped_rank_is_named_by_its_silent_heartbeat_in_shared_memory():
    seconds, message = _detected("stop", {"ZEROTRAIN_HEARTBEAT_TIMEOUT": "3"})
    assert "rank(s) [1] stopped answering" in message, message
    assert "stopped (SIGSTOP)" in message, message
    assert seconds < 10, seconds  # the heartbeat's 3 s, not the 40 s collective timeout


@pytest.mark.parametrize("how", ["exit", "stop"])
def test_a_dead_or_stopped_rank_is_named_over_gloo(how):
    # gloo alone says "connection closed by peer" or "timed out"; /proc (same machine) and
    # the heartbeats in the job's store name the rank. A stopped rank is found at the
    # collective timeout here (shorter than the peer watchdog's).
    seconds, message = _detected(how, {"ZEROTRAIN_SHM": "0"}, comm_timeout=8)
    named = "exited" if how == "exit" else "stopped answering"
    assert f"Rank(s) [1] {named}: rank 1 (host " in message, message
    state = "its process exited" if how == "exit" else "its process is stopped (SIGSTOP)"
    assert state in message, message
    assert seconds < (12 if how == "exit" else 20), seconds
