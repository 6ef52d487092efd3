"""Shared-memory collectives: same results as gloo's, chunking across slots, any dtype, and
a peer that exits is reported at once instead of after the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from zerotrain.comm import CollectiveError, Communicator
from zerotrain.testing.dist import DistributedTestError, run_distributed

SMALL_SLOTS = {"ZEROTRAIN_SHM_SLOT_BYTES": "4096"}  # forces many chunks per collective


def _every_op(numel: int, dtype: torch.dtype) -> dict[str, list]:
    comm = Communicator()
    rank, world = comm.rank, comm.world_size
    # Small integers: exact in every dtype (bf16 too) whatever the summation order.
    base = torch.arange(numel * world, dtype=torch.float64) % 31
    out: dict[str, list] = {"shm": [comm.uses_shared_memory]}
    t = (base[:numel] + rank).to(dtype)
    comm.all_reduce(t, purpose="gradients")
    out["sum"] = t.double().tolist()
    t = (base[:numel] * (rank + 1)).to(dtype)
    comm.all_reduce(t, purpose="control", op="max")
    out["max"] = t.double().tolist()
    full = (base + rank).to(dtype)
    mine = full.view(world, -1)[rank]
    comm.reduce_scatter(mine, full, purpose="gradients")  # in place
    out["rs"] = mine.double().tolist()
    shard = torch.full((numel,), float(rank + 1), dtype=dtype)
    gathered = torch.zeros(numel * world, dtype=dtype)
    comm.all_gather_into(gathered, shard, purpose="parameters")
    out["ag"] = gathered.double().tolist()
    b = (base[:numel] * (rank + 1)).to(dtype)
    comm.broadcast(b, src=world - 1, purpose="init")
    out["bcast"] = b.double().tolist()
    comm.barrier()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_matches_gloo(world_size, dtype):
    numel = 3001  # several 4 KiB slots, not a multiple of anything
    shared = run_distributed(_every_op, world_size, numel, dtype, env=SMALL_SLOTS)
    plain = run_distributed(_every_op, world_size, numel, dtype, env={"ZEROTRAIN_SHM": "0"})
    for rank in range(world_size):
        assert shared[rank].pop("shm") == [True]
        assert plain[rank].pop("shm") == [False]
        for key in shared[rank]:
            a, b = torch.tensor(shared[rank][key]), torch.tensor(plain[rank][key])
            bad = (a != b).nonzero().view(-1)
            assert len(bad) == 0, (
                rank,
                key,
                bad[:8].tolist(),
                a[bad[:4]].tolist(),
                b[bad[:4]].tolist(),
            )


def _peer_exits() -> None:
    comm = Communicator()
    if comm.rank == 1:
        os._exit(5)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000), purpose="gradients")
    except CollectiveError as err:
        raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {err}") from None


def test_a_peer_that_exits_is_reported_within_a_second():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_peer_exits, 2, timeout=60, comm_timeout=30)
    message = str(info.value)
    assert "rank 1 exited with code 5" in message
    assert "rank(s) [1] exited during a shared-memory all_reduce(sum) of gradients" in message
    seconds = float(message.split("RuntimeError: after ")[1].split(" s:")[0])
    assert seconds < 3  # noticed through the process id, long before the 30 s timeout


def _bf16_sum() -> float:
    comm = Communicator()
    value = 1.0 if comm.rank == 0 else 2.0**-8
    t = torch.tensor([value], dtype=torch.bfloat16)
    comm.all_reduce(t, purpose="gradients")
    return float(t)


def test_bf16_sums_are_accumulated_in_fp32():
    exact = float(torch.tensor(1.0 + 3 * 2.0**-8).bfloat16())  # 1.015625
    one_by_one = torch.tensor(1.0, dtype=torch.bfloat16)
    for _ in range(3):
        one_by_one += torch.tensor(2.0**-8, dtype=torch.bfloat16)  # each add rounds back to 1
    assert float(one_by_one) == 1.0
    assert run_distributed(_bf16_sum, 4) == [exact] * 4


def _different_collectives() -> None:
    comm = Communicator()
    try:
        if comm.rank == 0:
            comm.all_gather_into(torch.zeros(8), torch.zeros(4), purpose="parameters", label="a")
        else:
            comm.all_gather_into(torch.zeros(8), torch.zeros(4), purpose="parameters", label="b")
    except CollectiveError as err:
        raise RuntimeError(str(err)) from None


def test_ranks_in_different_collectives_fail_at_once_naming_both():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_different_collectives, 2, timeout=60, comm_timeout=30)
    message = str(info.value)
    for rank in (0, 1):  # each rank raised, and says what every rank was doing
        assert f"--- rank {rank} output ---" in message
    assert message.count("entered different collectives") == 2
    assert "rank 0: all_gather of parameters [a] ((8,) float32, 32 bytes)" in message
    assert "rank 1: all_gather of parameters [b] ((8,) float32, 32 bytes)" in message
