"""A rank killed outright over gloo TCP (``ZEROTRAIN_SHM=0``, what every multi-host job
uses) is named by the survivors, and no survivor is named with it (issue 42).

Found: in a rank started by ``fork`` (this suite's jobs; Python's default start method on
Linux) the heartbeat thread forgot the job's store as soon as it was registered, so after
the gloo error every rank, the survivors included, looked silent ("Rank(s) [1, 2] stopped
answering" on rank 0 when only rank 1 had died).
"""

from __future__ import annotations

import os
import signal

import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
from zerotrain.testing.dist import run_to_the_end


def _one_rank_killed() -> str:
    comm = Communicator()
    comm.all_reduce(torch.ones(4), purpose="gradients")
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100):
            comm.all_reduce(torch.ones(4), purpose="gradients")
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_survivors_name_the_killed_rank_and_only_it():
    outcome = run_to_the_end(
        _one_rank_killed, 3, timeout=60, comm_timeout=20, env={"ZEROTRAIN_SHM": "0"}
    )
    assert outcome.ranks[1].status == "died", outcome
    for rank in (0, 2):
        message = str(outcome.ranks[rank].value)
        assert "Rank(s) [1] stopped answering" in message, (rank, message)
