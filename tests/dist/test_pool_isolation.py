"""The worker pool isolates tests: a test that kills a rank, hangs, raises or leaves something
behind fails under its own name with the rank's report, the pool is replaced, and the test
after it passes in the new pool; clean tests share one pool. Runs ``pool_cases.py`` in a
pytest of its own (with the suite's conftest: pools on, and the budget guard at 8 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from zerotrain.comm import shm
from zerotrain.comm.liveness import process_state

ROOT = Path(__file__).resolve().parents[2]
CASES = "tests/dist/pool_cases.py"

# culprit -> what its failure must say (besides its own name)
FAILS = {
    "test_kills_a_rank": ["rank 1 exited with code -9"],
    "test_hangs": ["rank(s) [0] did not finish within 4s", "_hang_rank_zero"],
    "test_raises": ["rank 1 of 2 raised", "ValueError: rank one is unhappy"],
    "test_leaves_a_process_group": ["left behind", "process group of ranks [0, 1] was left"],
    "test_destroys_the_default_group": ["the default process group was destroyed or replaced"],
    "test_breaks_the_default_group": ["the default process group no longer works"],
    "test_leaves_an_environment_variable": ["environment variable POOL_CASES_LEAKED was set"],
    "test_patches_torch": ["torch.nn.functional.relu was replaced and not restored"],
    "test_leaves_a_thread": ["thread 'left-behind' is still running"],
    "test_leaves_a_file_open": ["held.txt is still open"],
    "test_over_budget": ["over the suite's budget of 8 s"],
}
FOLLOWERS = {
    "after_kill": "kills",
    "after_hang": "hangs",
    "after_raise": "raises",
    "after_group": "group",
    "after_default": "default",
    "after_stuck": "stuck",
    "after_env": "env",
    "after_patch": "patch",
    "after_thread": "thread",
    "after_file": "file",
}


def _outcomes(junit: Path) -> dict[str, str | None]:
    """test name -> None (passed) or its failure text."""
    out: dict[str, str | None] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        skipped = case.find("skipped")
        assert skipped is None, f"{case.get('name')} was skipped"
        out[case.get("name", "")] = (
            None if failure is None else failure.get("message", "") + (failure.text or "")
        )
    return out


@pytest.mark.budget(150, reason="a pytest of 26 cases, 12 of which break a pool on purpose")
def test_each_broken_test_is_named_and_the_next_one_passes(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.txt"
    junit = tmp_path / "junit.xml"
    env = {
        **os.environ,
        "POOL_CASES_PIDS": str(pids_file),
        "POOL_CASES_BUDGET": "1",
        "ZEROTRAIN_TEST_BUDGET_S": "8",
        "ZEROTRAIN_TEST_POOL": "1",
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", CASES, "-p", "no:cacheprovider", "-q", "--junitxml",
         str(junit)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert junit.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    outcomes = _outcomes(junit)
    for name, needles in FAILS.items():
        text = outcomes[name]
        assert text is not None, f"{name} passed; it must fail"
        for needle in [*needles, f"{CASES}::{name}"]:
            assert needle in text, f"{name}: {needle!r} not in its failure:\n{text[:3000]}"
    passed = {n for n, text in outcomes.items() if text is None}
    expected = {f"test_{f}" for f in FOLLOWERS} | {
        "test_clean_one",
        "test_clean_two",
        "test_random_numbers_start_fresh",
        "test_env_is_set_for_the_job_only",
    }
    assert passed == expected, {n: outcomes[n] for n in expected - passed}

    pids: dict[str, set[int]] = defaultdict(set)
    for line in pids_file.read_text().splitlines():
        test, _rank, pid = line.split()
        pids[test].add(int(pid))
    for follower, culprit in FOLLOWERS.items():
        assert pids[follower], f"{follower} never ran a rank"
        assert not pids[follower] & pids[culprit], f"{follower} ran in {culprit}'s broken pool"
    assert pids["clean_one"] == pids["clean_two"], "two clean tests did not share their pool"
    # Nothing is left once the session is over: no rank of any pool, no segment of theirs.
    every = set().union(*pids.values())
    alive = [pid for pid in every if process_state(pid) not in ("exited",)]
    assert not alive, f"pool ranks still there after the session: {alive}"
    assert shm.segments_of(every) == []
