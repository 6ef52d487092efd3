"""The multi-process test helper: results come back, failures surface, hangs time out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm.liveness import process_state
from zerotrain.testing.dist import DistributedTestError, run_distributed


def _sum_ranks(offset: int) -> tuple[int, float, str]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item() + offset, os.environ["OMP_NUM_THREADS"]


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def _hang_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        time.sleep(600)


def _die_on_rank_two() -> None:
    if dist.get_rank() == 2:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_distributed(_sum_ranks, world_size, 10)
    expected = sum(range(world_size)) + 10
    assert results == [(r, expected, "1") for r in range(world_size)]


def test_exception_names_rank_and_carries_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_one, 3)
    message = str(info.value)
    assert "rank 1 of 3 raised" in message
    assert "ValueError: rank one is unhappy" in message
    assert "_raise_on_rank_one" in message
    assert time.monotonic() - start < 30


def test_hang_fails_within_timeout_with_stacks():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "rank(s) [0] did not finish within 5s" in message
    assert "_hang_on_rank_zero" in message  # faulthandler stack of the stuck rank


def test_rank_that_dies_is_named_as_first_failure():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_on_rank_two, 3)
    assert "rank 2 exited with code 7 without reporting a result" in str(info.value)


def _write_pid_and_wait(directory: str) -> None:
    (Path(directory) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


_LAUNCHER = """
import sys
from tests.dist.test_harness import _write_pid_and_wait
from zerotrain.testing.dist import run_distributed
run_distributed(_write_pid_and_wait, 2, sys.argv[1], timeout=900)
"""


def test_ranks_end_when_the_launching_process_is_killed(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path)], cwd=root, start_new_session=True
    )
    ranks: list[int] = []
    try:
        pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert time.monotonic() < deadline, "the ranks never started"
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in pid_files]
        launcher.kill()  # SIGKILL: the launcher cannot clean up; its ranks must notice
        launcher.wait()
        killed = time.monotonic()
        while any(process_state(pid) == "running" for pid in ranks):
            assert time.monotonic() - killed < 10, "ranks outlived their launcher by 10 s"
            time.sleep(0.1)
        print(f"ranks ended {time.monotonic() - killed:.1f} s after the launcher was killed")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in ranks:  # a failed run must not leave ranks holding the test's output
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
