"""Tests that break a worker pool on purpose, each followed by one that must pass.

Not collected by the suite (no ``test_`` prefix): ``test_pool_isolation.py`` runs this file
in a pytest of its own and checks every case's outcome and message. Each rank appends
``<test> <rank> <pid>`` to the file named by ``POOL_CASES_PIDS``, so the outer test can tell
which pool ran what.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerotrain.testing.dist import run_distributed


def _note(test: str) -> None:
    with open(os.environ["POOL_CASES_PIDS"], "a") as f:
        f.write(f"{test} {dist.get_rank()} {os.getpid()}\n")


def _clean(test: str) -> float:
    """What every follower does: a collective, and checks that nothing earlier leaked."""
    _note(test)
    assert "POOL_CASES_LEAKED" not in os.environ
    assert F.relu.__module__ == "torch.nn.functional"
    assert list(dist.distributed_c10d._world.pg_map) == [dist.group.WORLD]
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _follower(name: str, **kwargs: float) -> None:
    assert run_distributed(_clean, 2, name, **kwargs) == [2.0, 2.0]


def _kill_rank_one() -> None:
    _note("kills")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _hang_rank_zero() -> None:
    _note("hangs")
    if dist.get_rank() == 0:
        time.sleep(600)


def _raise_on_rank_one() -> None:
    _note("raises")
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def _leave_a_group() -> None:
    _note("group")
    dist.new_group([0, 1])


def _destroy_the_default_group() -> None:
    _note("default")
    dist.destroy_process_group()


def _time_out_a_collective() -> None:
    _note("stuck")
    if dist.get_rank() == 0:  # rank 1 never joins: the pairs are out of step afterwards
        work = dist.all_reduce(torch.ones(1), async_op=True)
        with contextlib.suppress(RuntimeError):
            work.wait(timeout=datetime.timedelta(seconds=0.5))


def _leave_an_environment_variable() -> None:
    _note("env")
    os.environ["POOL_CASES_LEAKED"] = "1"


def _patch_torch() -> None:
    _note("patch")
    F.relu = lambda x, inplace=False: x


def _leave_a_thread() -> None:
    _note("thread")
    threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()


def _leave_a_file_open(path: str) -> None:
    _note("file")
    globals().setdefault("_kept", []).append(open(path))  # noqa: SIM115


def _draw() -> list[float]:
    _note("rng")
    return torch.rand(3).tolist()


def _getenv(name: str) -> str | None:
    return os.environ.get(name)


def _draw_after_seeding() -> None:
    torch.manual_seed(1234)


def test_kills_a_rank():
    run_distributed(_kill_rank_one, 2)


def test_after_kill():
    _follower("after_kill")


def test_hangs():
    run_distributed(_hang_rank_zero, 2, timeout=4)


def test_after_hang():
    _follower("after_hang")


def test_raises():
    run_distributed(_raise_on_rank_one, 2)


def test_after_raise():
    _follower("after_raise")


def test_leaves_a_process_group():
    run_distributed(_leave_a_group, 2)


def test_after_group():
    _follower("after_group")


def test_destroys_the_default_group():
    run_distributed(_destroy_the_default_group, 2)


def test_after_default():
    _follower("after_default")


def test_breaks_the_default_group():
    run_distributed(_time_out_a_collective, 2, comm_timeout=3)


def test_after_stuck():
    _follower("after_stuck", comm_timeout=3)  # the same pool's key as the culprit's


def test_leaves_an_environment_variable():
    run_distributed(_leave_an_environment_variable, 2)


def test_after_env():
    _follower("after_env")


def test_patches_torch():
    run_distributed(_patch_torch, 2)


def test_after_patch():
    _follower("after_patch")


def test_leaves_a_thread():
    run_distributed(_leave_a_thread, 2)


def test_after_thread():
    _follower("after_thread")


def test_leaves_a_file_open(tmp_path):
    path = tmp_path / "held.txt"
    path.write_text("x")
    run_distributed(_leave_a_file_open, 2, str(path))


def test_after_file():
    _follower("after_file")


def test_clean_one():
    _follower("clean_one")


def test_clean_two():
    _follower("clean_two")


def test_random_numbers_start_fresh():
    """A seed set by one test does not reach the next: each starts as a fresh process."""
    fresh = run_distributed(_draw, 2)
    run_distributed(_draw_after_seeding, 2)
    assert run_distributed(_draw, 2) == fresh


def test_env_is_set_for_the_job_only():
    assert run_distributed(_getenv, 2, "POOL_CASES_JOB", env={"POOL_CASES_JOB": "a"}) == ["a"] * 2
    assert run_distributed(_getenv, 2, "POOL_CASES_JOB") == [None, None]


@pytest.mark.skipif(os.environ.get("POOL_CASES_BUDGET") != "1", reason="budget case only")
def test_over_budget():
    time.sleep(float(os.environ["ZEROTRAIN_TEST_BUDGET_S"]) + 0.5)
