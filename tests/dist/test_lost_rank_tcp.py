"""A rank killed outright over gloo TCP (``ZEROTRAIN_SHM=0``, what every multi-host job
uses) is named by the survivors, and no survivor is named with it; a rank stopped with
SIGSTOP is named within the heartbeat timeout under plain torchrun (issue 42).

Found: in a rank started by ``fork`` (this suite's jobs; Python's default start method on
Linux) the heartbeat thread forgot the job's store as soon as it was registered, so after
the gloo error every rank, the survivors included, looked silent ("Rank(s) [1, 2] stopped
answering" on rank 0 when only rank 1 had died).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

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


_STOPPED_UNDER_TORCHRUN = """
import os, signal, time, torch, zerotrain
import torch.distributed as dist
from zerotrain.comm.collectives import Communicator
zerotrain.init_distributed()
comm = Communicator()
comm.all_reduce(torch.ones(4), purpose="warm-up")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
print(f"waiting {time.monotonic()}", flush=True)
comm.all_reduce(torch.ones(4), purpose="gradients")  # rank 1 never comes
"""


def test_a_stopped_rank_is_named_within_the_heartbeat_timeout_under_plain_torchrun(tmp_path):
    """The peer watchdog is on by default (it was only under ``zerotrain run`` across
    hosts): rank 0, blocked over TCP on a rank stopped with SIGSTOP, exits naming it after
    the heartbeat timeout, not the collective timeout (120 s here)."""
    script = tmp_path / "job.py"
    script.write_text(_STOPPED_UNDER_TORCHRUN)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")},
        "ZEROTRAIN_SHM": "0",
        "ZEROTRAIN_HEARTBEAT_TIMEOUT": "3",
        "ZEROTRAIN_COMM_TIMEOUT": "120",
        "OMP_NUM_THREADS": "1",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    job = subprocess.Popen(
        [*command, "--nproc-per-node=2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in job.stdout),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("stopped answering" in x for _, x in lines):
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the stopped rank included
        job.wait(timeout=30)
        reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    named = [(t, line) for t, line in lines if "stopped answering" in line]
    assert named, output
    assert "Rank(s) [1] stopped answering (no heartbeat for 3 s" in named[0][1], output
    waiting = [float(line.split()[1]) for _, line in lines if line.startswith("waiting ")]
    assert waiting, output
    seconds = named[0][0] - max(waiting)
    print(f"stopped rank named after {seconds:.1f} s (heartbeat timeout 3 s)")
    assert seconds < 3 + 5, output  # the timeout, the watchdog's 1 s polls, a loaded machine


def _slow_peer() -> str:
    comm = Communicator()
    comm.all_reduce(torch.ones(4), purpose="warm-up")
    if comm.rank == 1:
        time.sleep(6)  # alive and ticking, but late: rank 0's collective times out first
        return ""
    try:
        comm.all_reduce(torch.ones(4), purpose="gradients")
    except CollectiveError as err:
        return str(err)
    return "no error"


def test_a_failure_no_heartbeat_explains_says_it_cannot_tell():
    message = (
        run_to_the_end(_slow_peer, 2, timeout=60, comm_timeout=2, env={"ZEROTRAIN_SHM": "0"})
        .ranks[0]
        .value
    )
    assert "cannot be told from here" in str(message), message
    assert "stopped answering" not in str(message), message
