"""Point-to-point through the pairwise shared-memory channels (``comm/shm_p2p.py``): bitwise
the gloo path's results, opened lazily per pair, streamed through small slots, and clear
errors for a peer that died."""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm import CollectiveError, Communicator, P2POp
from zerotrain.testing.dist import DistributedTestError, run_distributed

# 4 KiB slots (4 per direction) and a 1 KiB threshold, so small tensors cover every route:
# below the threshold (header in the channel, payload over gloo), within one slot, exactly
# one slot, and many times the slots (the ring of slots wraps around).
SMALL = {"ZEROTRAIN_SHM_P2P_SLOT_BYTES": "4096", "ZEROTRAIN_SHM_P2P_MIN_BYTES": "1024"}
DTYPES = (torch.float32, torch.bfloat16, torch.int64)
NUMELS = (64, 512, 20_000)  # fp32: 256 B, 2 KiB, 80 KB; bf16: 128 B, 1 KiB, 40 KB; int64: ...


def _payload(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, (numel,), generator=gen)
    return torch.randn(numel, generator=gen).to(dtype)  # every bit pattern matters


def _ring(comm: Communicator) -> list[torch.Tensor]:
    """Every dtype and size, both directions at once, then send-first/recv-first pairs."""
    rank, n = comm.rank, comm.world_size
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    got = []
    for i, dtype in enumerate(DTYPES):
        for j, numel in enumerate(NUMELS):
            salt = 10 * i + j
            from_prev, from_next = torch.empty(numel, dtype=dtype), torch.empty(3, dtype=dtype)
            handle = comm.exchange(
                [
                    P2POp.send(_payload(rank, numel, dtype, salt), nxt, purpose="activations"),
                    P2POp.send(_payload(rank, 3, dtype, salt), prev, purpose="gradients"),
                    P2POp.recv(from_prev, prev, purpose="activations"),
                    P2POp.recv(from_next, nxt, purpose="gradients"),
                ],
                async_op=True,
            )
            handle.wait()
            assert handle.finished
            assert torch.equal(from_prev, _payload(prev, numel, dtype, salt)), (dtype, numel)
            assert torch.equal(from_next, _payload(nxt, 3, dtype, salt)), (dtype, numel)
            got += [from_prev, from_next]
    mine, theirs = _payload(rank, 30_000, torch.float32, 99), torch.empty(30_000)
    for _ in range(2):  # two in a row between the same pair keep their order
        if rank % 2 == 0:
            comm.send(mine, nxt, purpose="activations", label="mb0")
            comm.recv(theirs, prev, purpose="activations", label="mb0")
        else:
            comm.recv(theirs, prev, purpose="activations", label="mb0")
            comm.send(mine, nxt, purpose="activations", label="mb0")
        got.append(theirs.clone())
    return got


def _shm_vs_gloo() -> dict[str, object]:
    shared, gloo = Communicator(), Communicator(shared_memory=False)
    out: dict[str, object] = {"peers": shared.shared_memory_peers, "before": 0}
    out["before"] = shared.open_p2p_channels
    via_shm, via_gloo = _ring(shared), _ring(gloo)
    out["bitwise"] = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(via_shm, via_gloo, strict=True)
    )
    out["channels"] = (shared.open_p2p_channels, gloo.open_p2p_channels)
    out["stats"] = [c.snapshot().get(op) for c in (shared, gloo) for op in ("send", "recv")]
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_through_shared_memory_is_bitwise_the_gloo_path(world_size):
    for rank, out in enumerate(run_distributed(_shm_vs_gloo, world_size, env=SMALL)):
        assert out["peers"] == tuple(r for r in range(world_size) if r != rank)
        assert out["bitwise"]
        # Opened on first use, one per neighbour: never N - 1 up front.
        assert out["before"] == 0
        assert out["channels"] == (min(2, world_size - 1), 0)
        shm_send, shm_recv, gloo_send, gloo_recv = out["stats"]
        assert (shm_send, shm_recv) == (gloo_send, gloo_recv)


def _dead_peer(path: str) -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=20))
    big = torch.zeros(50_000)  # many slots
    if comm.rank == 1:
        comm.barrier()
        os._exit(3)
    comm.barrier()
    start = time.monotonic()
    try:
        comm.recv(big, 1, purpose="activations", label="mb2")
        message = "no error"
    except CollectiveError as err:
        message = f"{time.monotonic() - start:.1f}s: {err}"
    with open(path, "w") as f:
        f.write(message)
    return message


def test_dead_peer_is_named_at_once(tmp_path):
    path = str(tmp_path / "rank0.txt")
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 3"):
        run_distributed(_dead_peer, 2, path, timeout=60, comm_timeout=30, env=SMALL)
    seconds, message = Path(path).read_text().split("s: ", 1)
    assert float(seconds) < 2.0  # not the 20 s timeout
    assert message.startswith(
        "rank 0: rank 1 exited before issuing the matching point-to-point call; this rank is "
        "in recv of activations [mb2] ((50000,) float32, 200000 bytes) from rank 1 "
        "(shared-memory channel)"
    ), message


def _stopped_peer(path: str) -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=60))
    big = torch.zeros(50_000)  # many slots
    if comm.rank == 1:
        comm.send(big, 0, purpose="activations", label="mb1")  # the channel is open
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.recv(big, 1, purpose="activations", label="mb1")
    start = time.monotonic()
    try:
        comm.recv(big, 1, purpose="activations", label="mb2")
        message = "no error"
    except CollectiveError as err:
        message = f"{time.monotonic() - start:.1f}s: {err}"
    with open(path, "w") as f:
        f.write(message)
    raise RuntimeError(message)  # the harness then ends the stopped rank at once


def test_stopped_peer_is_named_by_its_silent_heartbeat(tmp_path):
    # Its process exists (a PID check sees nothing wrong); its heartbeat stands still.
    path = str(tmp_path / "rank0.txt")
    env = {**SMALL, "ZEROTRAIN_HEARTBEAT_TIMEOUT": "3"}
    with pytest.raises(DistributedTestError):
        run_distributed(_stopped_peer, 2, path, timeout=90, comm_timeout=60, env=env)
    seconds, message = Path(path).read_text().split("s: ", 1)
    print(f"stopped peer named after {seconds} s: {message}")
    assert float(seconds) < 10.0  # the 3 s heartbeat timeout, not the 60 s one
    assert message.startswith("rank 0: rank 1 stopped answering (no heartbeat for "), message
    assert "the process is stopped (SIGSTOP)" in message, message


def _sub_group() -> dict[str, object]:
    odd = dist.new_group([1, 3])
    even = dist.new_group([0, 2])
    group = odd if dist.get_rank() % 2 else even
    shared, gloo = Communicator(group), Communicator(group, shared_memory=False)
    peer = 1 - shared.rank
    results = []
    for comm in (shared, gloo):
        mine = _payload(dist.get_rank(), 10_000, torch.bfloat16, 7)
        theirs = torch.empty(10_000, dtype=torch.bfloat16)
        comm.exchange(
            [P2POp.send(mine, peer, purpose="activations"), P2POp.recv(theirs, peer, purpose="a")]
            if shared.rank == 0
            else [
                P2POp.recv(theirs, peer, purpose="activations"),
                P2POp.send(mine, peer, purpose="a"),
            ]
        )
        results.append(theirs)
    channels = shared.open_p2p_channels
    del shared, gloo
    dist.destroy_process_group(odd)
    dist.destroy_process_group(even)
    return {
        "bitwise": torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8)),
        "expected": torch.equal(
            results[0], _payload(dist.get_rank() ^ 2, 10_000, torch.bfloat16, 7)
        ),
        "channels": channels,
    }


def test_sub_group_of_two_out_of_four():
    for out in run_distributed(_sub_group, 4, env=SMALL):
        assert out == {"bitwise": True, "expected": True, "channels": 1}


def test_settings_are_checked():
    with pytest.raises(DistributedTestError, match="ZEROTRAIN_SHM_P2P_SLOT_BYTES must be a pos"):
        run_distributed(Communicator, 2, env={"ZEROTRAIN_SHM_P2P_SLOT_BYTES": "100"})
