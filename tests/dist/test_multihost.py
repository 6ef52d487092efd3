"""Jobs whose ranks run on separate network hosts (Linux network namespaces joined by a
switch, as machines on one network would be), against the same job on one host: 2 hosts of 2
ranks each equal 4 ranks on one host (fp32, 1e-5) at ZeRO stages 1 and 3, and a 3-host job
equals 3 ranks on one host. Ranks of one host may share memory; between hosts everything
crosses the link (gloo over TCP, each rank bound to its host's interface). Needs root
(skipped with the reason elsewhere)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.training import RunSpec, assert_matches, train_reference, train_zerotrain
from zerotrain.testing import netns
from zerotrain.testing.dist import run_distributed

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


def _spec(stage: int) -> RunSpec:
    return RunSpec(steps=4, micro_batch=2, grad_accum=2, clip=0.05, stage=stage)


def _same(got: dict, want: dict, tol: float = 1e-5) -> None:
    worst = max(abs(a - b) for a, b in zip(got["losses"], want["losses"], strict=True))
    assert worst <= tol, (worst, got["losses"], want["losses"])
    for name, value in want["params"].items():
        assert (got["params"][name] - value).abs().max().item() <= tol, name


def _train_each(specs: list[RunSpec]) -> list[dict]:
    """One job trains every spec in turn (a job across hosts starts fresh processes: one
    start-up for both stages)."""
    return [train_zerotrain(spec) for spec in specs]


def test_two_hosts_of_two_ranks_train_like_four_ranks_on_one_host():
    specs = [_spec(1), _spec(3)]
    one_host = run_distributed(_train_each, 4, specs, timeout=300)
    with netns.hosts(2) as (a, b):
        before = a.link_bytes()
        two_hosts = netns.run_on_hosts(_train_each, [a, a, b, b], specs, timeout=300)
        crossed = a.link_bytes() - before
    for i, spec in enumerate(specs):
        for rank in range(4):
            _same(two_hosts[rank][i], one_host[rank][i])
        assert_matches(two_hosts[0][i], train_reference(spec, 4))
    # Every step's reduction crossed the link (2 x 4 steps of a ~33k-parameter model in fp32).
    assert crossed > 2 * 4 * 4 * 33_000, crossed


def test_three_hosts_train_like_three_ranks_on_one_host():
    spec = _spec(2)
    one_host = run_distributed(train_zerotrain, 3, spec, timeout=300)
    with netns.hosts(3) as placement:
        three_hosts = netns.run_on_hosts(train_zerotrain, placement, spec, timeout=300)
    for rank in range(3):
        _same(three_hosts[rank], one_host[rank])


LEAVER = """
import os, signal, subprocess
from zerotrain.testing import netns
with netns.hosts(2) as placement:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    sleeper = placement[1].popen(["sleep", "600"], **quiet)
    print(placement[0].namespace, placement[1].namespace, sleeper.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs
"""


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_what_a_killed_run_left_is_removed_by_the_next():
    done = subprocess.run(
        [sys.executable, "-c", LEAVER], capture_output=True, text=True, timeout=60
    )
    first, second, sleeper = done.stdout.split()
    assert {first, second} <= _namespaces()
    assert Path(f"/proc/{sleeper}").exists()
    removed = netns.sweep_stale()
    assert {first, second} <= set(removed)
    assert not {first, second} & _namespaces()
    time.sleep(0.5)
    assert not Path(f"/proc/{sleeper}").exists() or "Z" in Path(f"/proc/{sleeper}/stat").read_text()
