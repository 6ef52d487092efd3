"""Shared-memory point-to-point: settings, routing and the liveness check, in one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from zerotrain.comm import liveness
from zerotrain.comm.shm_p2p import PairSettings, ShmPairs


def _pairs(min_bytes: int) -> ShmPairs:
    return ShmPairs(
        rank=0,
        world_size=3,
        token="test",
        pids=[os.getpid()] * 3,
        tags=["test"] * 3,
        local=[False, True, False],
        settings=PairSettings(min_bytes=min_bytes),
        timeout=1.0,
    )


def test_routes_cpu_messages_to_local_peers_from_the_threshold():
    pairs = _pairs(min_bytes=64)
    assert pairs.carries(1, torch.empty(16))  # 64 bytes
    assert not pairs.carries(1, torch.empty(15))
    assert not pairs.carries(2, torch.empty(1000))  # another host
    # Never a device tensor (the meta device stands in for CUDA here).
    assert not pairs.carries(1, torch.empty(1000, device="meta"))
    assert pairs.open_channels == 0  # nothing is opened before a message


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_SHM_P2P_MIN_BYTES", "4096")
    monkeypatch.setenv("ZEROTRAIN_SHM_P2P_SLOT_BYTES", "8192")
    settings = PairSettings.from_env()
    assert (settings.min_bytes, settings.slot_bytes) == (4096, 8192)
    assert settings.segment_bytes() == 4096 + 2 * settings.slots * 8192
    monkeypatch.setenv("ZEROTRAIN_SHM_P2P_MIN_BYTES", "-1")
    with pytest.raises(ValueError, match="ZEROTRAIN_SHM_P2P_MIN_BYTES must be >= 0, got -1"):
        PairSettings.from_env()


def test_process_state_tells_running_stopped_zombie_and_exited_apart():
    # What a waiting rank reads about a peer of its PID namespace (channels and arena).
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert liveness.process_state(child.pid) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        _until(lambda: liveness.process_state(child.pid) == "stopped (SIGSTOP)")
        os.kill(child.pid, signal.SIGKILL)
        # Ended, not yet reaped by its parent (this process): a zombie counts as gone.
        _until(lambda: liveness.process_state(child.pid).startswith("a zombie"))
    finally:
        child.kill()
        child.wait()
    assert liveness.process_state(child.pid) == "exited"


def _until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
