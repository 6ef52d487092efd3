"""Suite-wide settings: worker pools for multi-process tests, and the time budget.

* ``run_distributed`` jobs run in worker pools that outlive one test
  (``zerotrain.testing.pool``); ``ZEROTRAIN_TEST_POOL=0`` gives every job fresh ranks.
* Budget guard: a test whose set-up and run take more than ``BUDGET_S`` fails, unless it is
  marked ``@pytest.mark.budget(seconds, reason="...")``; then it fails past that mark's
  seconds. CI's whole suite has 30 minutes on two cores; a mark is a visible cost.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.faults import DETECTIONS
from zerotrain.testing import dist as dist_testing
from zerotrain.testing.pool import POOLS

BUDGET_S = float(os.environ.get("ZEROTRAIN_TEST_BUDGET_S", "60"))
_STARTED = time.monotonic()


def pytest_configure(config: pytest.Config) -> None:
    # Pipeline messages match by posting order under one tag, as NCCL matches them, with a
    # header check on each: a mis-ordered plan fails here instead of on a GPU (issue 41).
    # ZEROTRAIN_P2P_MATCH=tag runs the suite as users' gloo jobs run by default.
    os.environ.setdefault("ZEROTRAIN_P2P_MATCH", "order")
    dist_testing.use_pools(os.environ.get("ZEROTRAIN_TEST_POOL", "1") != "0")


def pytest_sessionfinish(session: pytest.Session) -> None:
    POOLS.close_all()


def _allowed_seconds(item: pytest.Item) -> float:
    mark = item.get_closest_marker("budget")
    if mark is None:
        return BUDGET_S
    seconds = mark.args[0] if mark.args else mark.kwargs.get("seconds")
    reason = mark.kwargs.get("reason", "")
    if not isinstance(seconds, (int, float)) or seconds <= BUDGET_S or not reason.strip():
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.budget needs seconds above {BUDGET_S:.0f} and a "
            f"reason, e.g. budget(120, reason='...'); got args={mark.args} kwargs={mark.kwargs}"
        )
    return float(seconds)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _allowed_seconds(item)  # a malformed mark fails the run before anything starts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_SETUP_S] = report.duration
        return
    if call.when != "call" or not report.passed:
        return
    spent = item.stash.get(_SETUP_S, 0.0) + report.duration
    allowed = _allowed_seconds(item)
    if spent > allowed:
        report.outcome = "failed"
        how = "its budget mark's" if item.get_closest_marker("budget") else "the suite's budget of"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (set-up and run), over {how} {allowed:.0f} s. "
            "Make it cheaper (smaller model, fewer steps, a shorter timeout through the "
            "existing knobs) or mark it @pytest.mark.budget(seconds, reason=...)."
        )


_SETUP_S = pytest.StashKey[float]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    wall = time.monotonic() - _STARTED
    jobs = ", ".join(
        f"{n} {how} at world size {ws}" for (how, ws), n in sorted(dist_testing.JOBS.items())
    )
    if DETECTIONS:
        terminalreporter.write_sep("-", "fault injection: lost rank named after (tests/faults)")
        for line in DETECTIONS:
            terminalreporter.write_line(line)
    terminalreporter.write_line(
        f"suite wall time: {wall:.0f} s ({wall / 60:.1f} min); worker pools started: "
        f"{POOLS.started}; multi-process jobs: {jobs or 'none'}"
    )
