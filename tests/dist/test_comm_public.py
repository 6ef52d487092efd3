"""``import zerotrain.comm as dist`` in a DeepSpeed script: torch.distributed's functions
with torch's documented results (2 ranks), each call counted in the communicator's stats
(purpose "user") and, once configured, timed by the comms logger."""

from __future__ import annotations

import torch

import zerotrain.comm as zdist
from zerotrain.comm import public
from zerotrain.testing.dist import run_distributed


def _script() -> dict:
    rank, world = zdist.get_rank(), zdist.get_world_size()
    seen: dict = {"rank": rank, "world": world, "local": zdist.get_local_rank()}
    zdist.configure(enabled=True, prof_all=True)
    zdist.barrier()

    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    zdist.all_reduce(t)
    seen["sum"] = t.tolist()
    t = torch.tensor([float(rank)])
    zdist.all_reduce(t, op=zdist.ReduceOp.MAX)
    seen["max"] = t.item()
    t = torch.tensor([float(rank)])
    zdist.all_reduce(t, op=zdist.ReduceOp.AVG)
    seen["avg"] = t.item()
    t = torch.tensor([2.0 + rank])
    zdist.all_reduce(t, op=zdist.ReduceOp.PRODUCT)  # not counted: torch.distributed's own
    seen["product"] = t.item()

    t = torch.full((3,), float(rank))
    zdist.broadcast(t, src=1)
    seen["broadcast"] = t.tolist()

    parts = [torch.zeros(2) for _ in range(world)]
    zdist.all_gather(parts, torch.full((2,), float(rank)))
    seen["all_gather"] = [p.tolist() for p in parts]
    out = torch.zeros(world, 2)
    zdist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    seen["all_gather_into_tensor"] = out.tolist()

    full = torch.arange(4.0) + 10 * rank  # rank 0: 0..3, rank 1: 10..13
    mine = torch.zeros(2)
    zdist.reduce_scatter_tensor(mine, full)
    seen["reduce_scatter_tensor"] = mine.tolist()
    seen["input_untouched"] = full.tolist()
    mine = torch.zeros(2)
    zdist.reduce_scatter(mine, [torch.ones(2) * rank, torch.ones(2) * (rank + 5)])
    seen["reduce_scatter"] = mine.tolist()

    out = torch.zeros(2)
    zdist.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    seen["all_to_all_single"] = out.tolist()

    if rank == 0:
        zdist.send(torch.tensor([42.0]), dst=1)
        got = torch.zeros(1)
        zdist.irecv(got, src=1).wait()
        seen["p2p"] = got.item()
    else:
        got = torch.zeros(1)
        zdist.recv(got, src=0)
        zdist.isend(torch.tensor([got.item() + 1]), dst=0).wait()
        seen["p2p"] = got.item()

    pair = zdist.new_group([0, 1])
    t = torch.ones(1)
    handle = zdist.all_reduce(t, group=pair, async_op=True)
    handle.wait()
    seen["group_sum"] = t.item()
    zdist.destroy_process_group(pair)  # and its communicator

    stats = public._communicator(None).snapshot()
    seen["counted_all_reduce"] = stats.get(op="all_reduce", purpose="user").calls
    seen["summary"] = zdist.log_summary()
    return seen


def test_zerotrain_comm_works_as_torch_distributed():
    r0, r1 = run_distributed(_script, 2)
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert (r0["local"], r1["local"]) == (0, 1)
    for seen in (r0, r1):
        assert seen["sum"] == [3.0, 30.0]
        assert seen["max"] == 1.0
        assert seen["avg"] == 0.5
        assert seen["product"] == 6.0
        assert seen["broadcast"] == [1.0, 1.0, 1.0]
        assert seen["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert seen["all_gather_into_tensor"] == [[0.0, 0.0], [1.0, 1.0]]
        assert seen["group_sum"] == 2.0
        assert seen["counted_all_reduce"] == 3  # sum, max, avg (the group's is its own)
        assert "all_reduce" in seen["summary"]
    assert r0["reduce_scatter_tensor"] == [10.0, 12.0]
    assert r1["reduce_scatter_tensor"] == [14.0, 16.0]
    assert r0["input_untouched"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["reduce_scatter"] == [1.0, 1.0]  # 0 + 1
    assert r1["reduce_scatter"] == [11.0, 11.0]  # 5 + 6
    assert r0["all_to_all_single"] == [0.0, 10.0]
    assert r1["all_to_all_single"] == [1.0, 11.0]
    assert r1["p2p"] == 42.0
    assert r0["p2p"] == 43.0
