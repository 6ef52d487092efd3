"""Collectives: results, async handles, byte accounting, and clear errors."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm import CollectiveError, Communicator
from zerotrain.testing.dist import DistributedTestError, run_distributed


def _collectives(async_op: bool) -> dict[str, object]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    out = {}
    t = torch.full((6,), float(rank + 1))
    comm.all_reduce(t, purpose="gradients", async_op=async_op).wait()
    out["all_reduce"] = t.tolist()

    full = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(2)
    done = []
    handle = comm.reduce_scatter(
        shard, full, purpose="gradients", async_op=async_op, on_done=lambda: done.append(1)
    )
    handle.wait()
    handle.wait()  # idempotent: on_done runs once
    out["reduce_scatter"] = shard.tolist()
    out["on_done_calls"] = len(done)

    gathered = torch.empty(2 * world)
    comm.all_gather_into(
        gathered, torch.full((2,), float(rank)), purpose="parameters", async_op=async_op
    ).wait()
    out["all_gather"] = gathered.tolist()

    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=world - 1, purpose="init", async_op=async_op).wait()
    out["broadcast"] = b.tolist()
    out["floats"] = comm.all_reduce_floats([1.0, float(rank)], op="max")
    comm.barrier()
    snap = comm.snapshot()
    out["stats"] = {
        (op, purpose): (c.calls, c.bytes, c.payload_bytes)
        for (op, purpose), c in snap.counts.items()
    }
    return out


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_collective_results_and_volume_accounting(world_size, async_op):
    results = run_distributed(_collectives, world_size, async_op)
    n = world_size
    total = n * (n + 1) / 2
    for rank, out in enumerate(results):
        assert out["all_reduce"] == [total] * 6
        expected_shard = [(2 * rank + k) * total for k in range(2)]
        assert out["reduce_scatter"] == expected_shard
        assert out["on_done_calls"] == 1
        assert out["all_gather"] == [float(r) for r in range(n) for _ in range(2)]
        assert out["broadcast"] == [float(n - 1)] * 3
        assert out["floats"] == [1.0, float(n - 1)]
        stats = out["stats"]
        # ZeRO paper model: all-reduce of S bytes moves 2S; RS/AG of a full tensor S moves S.
        assert stats[("all_reduce", "gradients")] == (1, 2 * 24, 24)
        assert stats[("reduce_scatter", "gradients")] == (1, 8 * n, 8 * n)
        assert stats[("all_gather", "parameters")] == (1, 8 * n, 8 * n)
        assert stats[("broadcast", "init")] == (1, 12, 12)
        assert stats[("all_reduce", "control")] == (1, 2 * 16, 16)


def _peer_dies() -> None:
    comm = Communicator(timeout=datetime.timedelta(seconds=20))
    if comm.rank == 1:
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(4), purpose="gradients", async_op=True).wait()
    except CollectiveError as err:
        raise RuntimeError(f"caught: {err}") from None


def test_dead_peer_gives_collective_error_naming_rank_and_op():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_peer_dies, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 exited with code 3" in message
    assert "caught: rank 0: all_reduce of gradients ((4,) float32, 16 bytes) failed" in message
    assert "rank(s) [1] exited" in message  # named, not guessed


def _size_mismatch() -> None:
    comm = Communicator()
    comm.reduce_scatter(torch.empty(3), torch.empty(5), purpose="gradients")


def test_shape_mismatch_is_an_invariant_error():
    with pytest.raises(DistributedTestError, match="full has 5 elements, expected 3 x 2"):
        run_distributed(_size_mismatch, 2)


def test_communicator_needs_a_process_group():
    assert not dist.is_initialized()  # the test process itself never joins a group
    with pytest.raises(Exception, match="initialised process group"):
        Communicator()


def _one_rank_never_joins() -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=3))
    if comm.rank == 1:
        time.sleep(8)  # never issues the collective
        return "slept"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), purpose="gradients")
    except CollectiveError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


def test_collective_that_never_completes_times_out_with_its_name():
    out = run_distributed(_one_rank_never_joins, 2, timeout=60, comm_timeout=3)[0]
    seconds, message = out.split("s: ", 1)
    assert float(seconds) < 10
    assert message.startswith("rank 0: all_reduce of gradients ((2,) float32, 8 bytes")
