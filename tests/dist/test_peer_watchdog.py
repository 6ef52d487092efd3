"""The peer watchdog (``ZEROTRAIN_PEER_TIMEOUT``): a rank waiting in a gloo collective for a
peer that fell silent (stopped with SIGSTOP here; a host cut off from the network in
tests/cli/test_elastic_hosts.py) exits after that many seconds of the peer's silence,
naming it, instead of waiting out the collective timeout (120 s here). A peer that is merely
slow keeps ticking, and a rank that is not waiting is never stopped."""

from __future__ import annotations

import os
import signal
import time

import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.testing.netns import Job, Local

ENV = {
    "ZEROTRAIN_SHM": "0",  # gloo: shared memory has its own, faster heartbeat check
    "ZEROTRAIN_PEER_TIMEOUT": "4",
    "ZEROTRAIN_COMM_TIMEOUT": "120",
}


def _silent_peer(slow_first: float) -> str:
    comm = Communicator()
    comm.barrier()
    if comm.rank == 1:
        time.sleep(slow_first)  # slow, but alive: must not be taken for dead
        comm.all_reduce(torch.ones(10), purpose="gradients")
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        comm.all_reduce(torch.ones(10), purpose="gradients")  # waits slow_first seconds
    start = time.monotonic()
    comm.all_reduce(torch.ones(10), purpose="gradients")  # rank 1 never comes
    return f"returned after {time.monotonic() - start:.1f} s"


def test_a_silent_peer_ends_the_waiting_rank_within_the_peer_timeout():
    with Job(_silent_peer, [Local(), Local()], 8.0, env=ENV) as job:
        start = time.monotonic()
        job.wait([0], timeout=60)
        ended = time.monotonic() - start
        code = job.procs[0].returncode
        output = job.outputs()
    assert code == 75, output
    assert "Rank(s) [1] stopped answering (no heartbeat for 4 s" in output, output
    # Rank 1 was slow for 8 s first (twice the timeout) and was not given up on then.
    assert 8 + 4 <= ended < 8 + 30, (ended, output)
