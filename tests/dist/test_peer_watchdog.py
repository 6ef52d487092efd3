"""The peer watchdog (``ZEROTRAIN_PEER_TIMEOUT``): a rank waiting in a gloo collective for a
peer that fell silent (stopped with SIGSTOP here; a host cut off from the network in
tests/cli/test_elastic_hosts.py) exits after that many seconds of the peer's silence,
naming it, instead of waiting out the collective timeout (120 s here). A peer that is merely
slow keeps ticking, and a rank that is not waiting is never stopped.

In NCCL's mode (the host never waits inside zerotrain there: the device does) the
watchdog reads the heartbeats all along; it is exercised here on CPU with a peer that is
only a store client, through the same code as on a GPU."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerotrain.comm import liveness
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


# A peer that is only a store client: it records itself and ticks its heartbeat as global
# rank 1, as every rank does when its heartbeats start, then ends as told.
_STORE_ONLY_PEER = """
import datetime, sys, time
import torch.distributed as dist
from zerotrain.comm import liveness
port, ending = int(sys.argv[1]), sys.argv[2]
connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False,
                                timeout=datetime.timedelta(seconds=30))
liveness.start_store_heartbeats(1, connect)
print("ready", flush=True)
time.sleep(1.5)
if ending == "raise":
    raise ValueError("bad batch")
if ending == "clean":
    sys.exit(0)
time.sleep(120)  # killed here by the test
"""


def _watch_store_only_peer(tmp_path: Path, ending: str, watch_s: float) -> tuple[list[str], float]:
    """Rank 0's watchdog in NCCL's mode (this process; its reports are recorded) over a
    store-only rank 1 that ends as ``ending`` says; returns what the watchdog said within
    ``watch_s`` seconds of the peer's end, and how long it took."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "peer.py"
    script.write_text(_STORE_ONLY_PEER)
    peer = subprocess.Popen(
        [sys.executable, str(script), str(server.port), ending],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said: list[str] = []
    watchdog = None
    try:
        assert peer.stdout is not None
        assert peer.stdout.readline().strip() == "ready"
        watchdog = liveness.PeerWatchdog(
            0,
            2,
            lambda: dist.TCPStore(
                "127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5)
            ),
            2.0,
            give_up=said.append,
            only_while_waiting=False,
            report=said.append,
        )
        if ending == "kill":
            time.sleep(1.5)
            peer.kill()
        peer.wait(timeout=30)
        ended = time.monotonic()
        deadline = ended + watch_s
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        return said, time.monotonic() - ended
    finally:
        if watchdog is not None:
            watchdog.stop()
        peer.kill()


def test_nccl_mode_names_a_killed_peer_after_the_peer_timeout(tmp_path):
    said, seconds = _watch_store_only_peer(tmp_path, "kill", 10.0)
    host = socket.gethostname()
    assert said, "not named"
    assert said[0].startswith("Rank(s) [1] stopped answering (no heartbeat for 2 s"), said
    assert f"rank 1 (host {host}, pid " in said[0], said
    assert 1.0 <= seconds < 2 + 2 + 2, seconds  # the timeout, 1 s polls, a loaded machine


def test_nccl_mode_names_a_peer_that_raised_at_once(tmp_path):
    said, seconds = _watch_store_only_peer(tmp_path, "raise", 10.0)
    assert said, "not named"
    assert said[0].startswith("Rank(s) [1] exited: rank 1 (host "), said
    assert "its exit marker says: exited after an uncaught ValueError: bad batch" in said[0]
    assert seconds < 2.0, seconds  # the next 1 s poll, not the 2 s of silence


def test_nccl_mode_lets_a_peer_that_finished_go(tmp_path):
    said, _ = _watch_store_only_peer(tmp_path, "clean", 3.5)  # the 2 s timeout, a poll
    assert said == []
