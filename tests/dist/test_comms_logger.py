"""The comms logger: exact counts and bytes, positive latencies, nccl-tests bandwidth ratios,
the ``prof_ops`` filter, verbose lines, and no timing at all when disabled."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from zerotrain.comm import Communicator
from zerotrain.comm import comms_logger as comms_logger_module
from zerotrain.comm.comms_logger import CommsLoggerPolicy, bus_factor, canonical_op
from zerotrain.testing.dist import run_distributed

# (op, purpose, payload bytes, calls) issued by _issue_known on every rank.
KNOWN = [
    ("all_reduce", "gradients", 1024 * 4, 3),
    ("reduce_scatter", "gradients", 2048 * 4, 2),
    ("all_gather", "parameters", 2048 * 4, 2),
    ("broadcast", "init", 256 * 4, 1),
]


def _issue_known(comm: Communicator, async_op: bool) -> None:
    world = comm.world_size
    for _ in range(3):
        comm.all_reduce(torch.ones(1024), purpose="gradients", async_op=async_op).wait()
    for _ in range(2):
        full = torch.ones(2048)
        comm.reduce_scatter(
            torch.empty(2048 // world), full, purpose="gradients", async_op=async_op
        ).wait()
    for _ in range(2):
        out = torch.empty(2048)
        comm.all_gather_into(
            out, torch.ones(2048 // world), purpose="parameters", async_op=async_op, label="blk"
        ).wait()
    comm.broadcast(torch.ones(256), purpose="init", async_op=async_op).wait()


def _plain(comm: Communicator) -> dict[str, Any]:
    """Picklable view of the summary and the counters."""
    summary = comm.comms_summary()
    return {
        "entries": {
            tuple(key): (t.calls, t.payload_bytes, t.bus_bytes, t.total_s, t.min_s, t.max_s)
            for key, t in summary.entries.items()
        },
        "ratios": {
            op: summary.get(op).busbw / summary.get(op).algbw
            for op, *_ in KNOWN
            if summary.get(op).calls
        },
        "table": summary.table(),
        "per_op_table": summary.table(by_size=False),
        "stats": {key: c.calls for key, c in comm.snapshot().counts.items()},
    }


def _profile_all(async_op: bool) -> dict[str, Any]:
    comm = Communicator()
    comm.configure_logger(CommsLoggerPolicy(enabled=True))
    _issue_known(comm, async_op)
    out = _plain(comm)
    out["shm"] = comm.uses_shared_memory
    return out


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("async_op", [False, True])
def test_counts_bytes_latency_and_bandwidth(async_op: bool, shm: str) -> None:
    results = run_distributed(_profile_all, 2, async_op, env={"ZEROTRAIN_SHM": shm})
    for out in results:
        entries = out["entries"]
        # Overlapped only when the backend left work in flight (gloo async); the
        # shared-memory path completes inside the call, so its time is exact.
        overlapped = async_op and not out["shm"]
        assert sorted(entries) == sorted(
            (op, purpose, size, overlapped, None) for op, purpose, size, _ in KNOWN
        )
        for op, purpose, size, calls in KNOWN:
            n, payload, bus, total, lo, hi = entries[(op, purpose, size, overlapped, None)]
            assert (n, payload) == (calls, calls * size)
            assert bus == pytest.approx(calls * size * bus_factor(op, 2))
            assert 0 < lo <= total / n <= hi
        # nccl-tests at n=2: all-reduce 2(n-1)/n = 1, all-gather / reduce-scatter 1/2, bcast 1.
        assert out["ratios"] == pytest.approx(
            {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}
        )
        # The logger adds to CommStats, it does not change it.
        for op, purpose, _, calls in KNOWN:
            assert out["stats"][(op, purpose)] == calls
        assert len(out["table"].splitlines()) == 1 + len(KNOWN)
        assert "busbw GB/s" in out["table"].splitlines()[0]


def _profile_some() -> dict[str, Any]:
    comm = Communicator()
    policy = CommsLoggerPolicy(
        enabled=True, prof_all=False, prof_ops=("all_gather_into_tensor", "broadcast")
    )
    comm.configure_logger(policy)
    _issue_known(comm, async_op=False)
    out = _plain(comm)
    out["prof_ops"] = policy.prof_ops
    return out


def test_prof_ops_filter_with_deepspeed_aliases() -> None:
    for out in run_distributed(_profile_some, 2):
        assert out["prof_ops"] == ("all_gather", "broadcast")
        assert {key[0] for key in out["entries"]} == {"all_gather", "broadcast"}
        assert out["stats"][("all_reduce", "gradients")] == 3  # still counted, not timed


def _verbose(debug: bool) -> dict[str, Any]:
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    # On the module's own logger: every rank sees its records (the rank-0 filter sits on
    # the library's stderr handler, not here).
    logging.getLogger("zerotrain.comm.comms_logger").addHandler(Capture())
    comm = Communicator()
    comm.configure_logger(CommsLoggerPolicy(enabled=True, verbose=True, debug=debug))
    _issue_known(comm, async_op=True)
    out = _plain(comm)
    out["records"] = records
    return out


@pytest.mark.parametrize("debug", [False, True])
def test_verbose_logs_one_line_per_collective(debug: bool) -> None:
    for out in run_distributed(_verbose, 2, debug):
        lines = out["records"]
        assert len(lines) == sum(calls for *_, calls in KNOWN)
        assert sum("comm op: all_reduce | purpose: gradients" in line for line in lines) == 3
        assert all("latency:" in line and "busbw:" in line for line in lines)
        gathers = [line for line in lines if "all_gather" in line]
        assert all("msg size: 8.00 KiB" in line for line in gathers)
        # debug names the caller (the label) in the lines and splits the summary by it.
        assert all(("[blk]" in line) == debug for line in gathers)
        labels = {key[4] for key in out["entries"] if key[0] == "all_gather"}
        assert labels == ({"blk"} if debug else {None})
        assert ("caller" in out["table"]) == debug


class _NoTiming:
    def __init__(self, *args: object) -> None:
        raise AssertionError("a collective was timed with the logger disabled")


def _disabled() -> dict[str, Any]:
    # Any timer construction (the only place that reads the clock or synchronises) fails.
    comms_logger_module.OpTimer = _NoTiming  # type: ignore[misc,assignment]
    comm = Communicator()
    _issue_known(comm, async_op=True)  # default policy: disabled
    comm.configure_logger(CommsLoggerPolicy(enabled=False, verbose=True, prof_all=True))
    _issue_known(comm, async_op=False)
    return _plain(comm)


def test_disabled_logger_times_nothing() -> None:
    for out in run_distributed(_disabled, 2):
        assert out["entries"] == {}
        assert out["stats"][("all_reduce", "gradients")] == 6


def test_unknown_prof_op_is_a_value_error_listing_allowed_names() -> None:
    with pytest.raises(ValueError, match="unknown collective 'barrier'") as info:
        CommsLoggerPolicy(enabled=True, prof_all=False, prof_ops=("barrier",))
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send"):
        assert name in str(info.value)
    assert canonical_op("reduce_scatter_tensor") == "reduce_scatter"
    assert canonical_op("all_gather_base") == "all_gather"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors_follow_nccl_tests(n: int) -> None:
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bus_factor("broadcast", n) == 1.0
