"""Point-to-point exchanges and all-to-all: results against local references, counting,
sub-groups, and clear errors for mismatched pairs, disagreeing splits and absent peers."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from zerotrain.comm import CollectiveError, Communicator, P2POp
from zerotrain.comm.comms_logger import CommsLoggerPolicy
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SMALL_SLOTS = {"ZEROTRAIN_SHM_SLOT_BYTES": "4096"}  # several all-to-all rounds per call


def _payload(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    # Small integers: exact in bf16 too, and distinct per rank.
    return ((torch.arange(numel) + 7 * rank + 3 * salt) % 97).to(dtype)


def _ring() -> dict[str, object]:
    comm = Communicator()
    comm.configure_logger(CommsLoggerPolicy(enabled=True))
    rank, n = comm.rank, comm.world_size
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    out: dict[str, object] = {}
    for i, dtype in enumerate(DTYPES):
        # Both directions at once: to the next and the previous rank (the same peer on 2).
        to_next, to_prev = _payload(rank, 5, dtype, 2 * i), _payload(rank, 3, dtype, 2 * i + 1)
        from_prev, from_next = torch.empty(5, dtype=dtype), torch.empty(3, dtype=dtype)
        handle = comm.exchange(
            [
                P2POp.send(to_next, nxt, purpose="activations"),
                P2POp.send(to_prev, prev, purpose="gradients"),
                P2POp.recv(from_prev, prev, purpose="activations"),
                P2POp.recv(from_next, nxt, purpose="gradients"),
            ],
            async_op=True,
        )
        handle.wait()
        assert torch.equal(from_prev, _payload(prev, 5, dtype, 2 * i)), (dtype, from_prev)
        assert torch.equal(from_next, _payload(nxt, 3, dtype, 2 * i + 1)), (dtype, from_next)
    # Plain send/recv, ordered so that each pair's calls line up: even ranks send first.
    mine, theirs = _payload(rank, 4, torch.float32), torch.empty(4)
    if rank % 2 == 0:
        comm.send(mine, nxt, purpose="activations", label="mb0")
        comm.recv(theirs, prev, purpose="activations", label="mb0")
    else:
        comm.recv(theirs, prev, purpose="activations", label="mb0")
        comm.send(mine, nxt, purpose="activations", label="mb0")
    assert torch.equal(theirs, _payload(prev, 4, torch.float32))
    comm.exchange([])  # nothing to do: no error, nothing counted
    snap = comm.snapshot()
    out["send"] = (snap.get("send").calls, snap.get("send").bytes)
    out["recv"] = (snap.get("recv").calls, snap.get("recv").bytes)
    out["send_activations"] = snap.get("send", "activations").calls
    summary = comm.comms_summary()
    out["logged"] = {op: summary.get(op).calls for op in ("send_recv", "send", "recv")}
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_exchange_both_directions(world_size):
    for rank, out in enumerate(run_distributed(_ring, world_size)):
        # Per dtype: 5 + 3 elements each way; fp32 4, bf16 2, int64 8 bytes.
        exchanged = (5 + 3) * (4 + 2 + 8)
        assert out["send"] == (2 * len(DTYPES) + 1, exchanged + 16), rank
        assert out["recv"] == (2 * len(DTYPES) + 1, exchanged + 16), rank
        assert out["send_activations"] == len(DTYPES) + 1
        assert out["logged"] == {"send_recv": len(DTYPES), "send": 1, "recv": 1}


def _all_to_all(compare_paths: bool) -> dict[str, object]:
    comm = Communicator()
    rank, n = comm.rank, comm.world_size

    def sends(i: int) -> list[int]:  # rows rank i sends to each rank: uneven, some zero
        return [(i + 2 * j) % 3 for j in range(n)]

    out: dict[str, object] = {"shm": comm.uses_shared_memory}
    for dtype in DTYPES:
        width = 3 if dtype == torch.bfloat16 else 1
        inputs = [_payload(i, sum(sends(i)) * width, dtype).view(-1, width) for i in range(n)]
        recvs = [sends(i)[rank] for i in range(n)]
        output = torch.full((sum(recvs), width), -1, dtype=dtype)
        handle = comm.all_to_all(
            output,
            inputs[rank],
            output_split_sizes=recvs,
            input_split_sizes=sends(rank),
            purpose="tokens",
            async_op=True,
        )
        handle.wait()
        pieces = [inputs[i].split(sends(i))[rank] for i in range(n)]
        assert torch.equal(output, torch.cat(pieces)), (dtype, output, pieces)
        out[str(dtype)] = output.tolist()
    even_in = _payload(rank, 4 * n, torch.float32)
    even_out = torch.empty(4 * n)
    comm.all_to_all(even_out, even_in, purpose="tokens", label="even")
    expected = torch.cat(
        [_payload(i, 4 * n, torch.float32)[4 * rank : 4 * rank + 4] for i in range(n)]
    )
    assert torch.equal(even_out, expected)
    empty = torch.empty(0)
    comm.all_to_all(empty, empty, purpose="tokens")  # nothing anywhere
    snap = comm.snapshot()
    out["stats"] = (snap.get("all_to_all").calls, snap.get("all_to_all").bytes)
    try:
        comm.all_to_all(even_out, even_in, input_split_sizes=[1] * n, purpose="tokens")
    except ValueError as err:
        out["bad_sum"] = str(err)
    return out


@pytest.mark.parametrize("path", ["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_uneven_and_empty_splits(world_size, path):
    env = SMALL_SLOTS if path == "shm" else {"ZEROTRAIN_SHM": "0"}
    results = run_distributed(_all_to_all, world_size, path == "shm", env=env)
    n = world_size
    for rank, out in enumerate(results):
        assert out["shm"] == (path == "shm")
        sent = sum((rank + 2 * j) % 3 for j in range(n))
        # One call per dtype (fp32 rows of 1, bf16 rows of 3, int64 rows of 1), the even
        # one (4n fp32) and the empty one; bytes are this rank's input.
        assert out["stats"] == (5, sent * (4 + 6 + 8) + 16 * n)
        assert f"input_split_sizes [{', '.join(['1'] * n)}] sum to {n}" in out["bad_sum"]
    if path == "shm" and n == 3:
        # Bitwise the same as gloo's (the reference check above covers every case; this
        # compares the two paths directly once).
        plain = run_distributed(_all_to_all, n, False, env={"ZEROTRAIN_SHM": "0"})
        for shared, gloo in zip(results, plain, strict=True):
            for dtype in DTYPES:
                assert shared[str(dtype)] == gloo[str(dtype)]


def _mismatched_pair(case: str) -> str:
    comm = Communicator()
    peer = 1 - comm.rank
    try:
        if case == "shape":
            if comm.rank == 0:
                comm.send(torch.ones(4), peer, purpose="activations", label="mb1")
            else:
                comm.recv(torch.empty(5), peer, purpose="activations", label="mb1")
        elif case == "both_send":
            comm.send(torch.ones(4), peer, purpose="activations")
        elif case == "splits":
            # rank 0 sends rank 1 two rows; rank 1 expects three.
            rows_out = [1, 2] if comm.rank == 0 else [3, 1]
            comm.all_to_all(
                torch.empty(sum(rows_out)),
                torch.zeros(3),
                output_split_sizes=rows_out,
                input_split_sizes=[1, 2],
                purpose="tokens",
            )
    except CollectiveError as err:
        return str(err)
    return "no error"


# Peers on one host check headers through their shared-memory channel, others over gloo:
# the same messages either way.
PATHS = {"shm": {}, "gloo": {"ZEROTRAIN_SHM": "0"}}


@pytest.mark.parametrize("path", PATHS)
def test_send_recv_shape_mismatch_fails_on_both_sides_naming_both(path):
    messages = run_distributed(
        _mismatched_pair, 2, "shape", timeout=60, comm_timeout=20, env=PATHS[path]
    )
    for rank, message in enumerate(messages):
        assert message.startswith(
            f"rank {rank}: the point-to-point calls of this rank and rank {1 - rank}"
        )
        assert "activations [mb1] ((4,) float32, 16 bytes)" in message
        assert "activations [mb1] ((5,) float32, 20 bytes)" in message
    assert "rank 1 announced: sends nothing, receives [activations [mb1] ((5,)" in messages[0]


@pytest.mark.parametrize("path", PATHS)
def test_send_met_by_send_fails_on_both_sides(path):
    messages = run_distributed(
        _mismatched_pair, 2, "both_send", timeout=60, comm_timeout=20, env=PATHS[path]
    )
    for rank, message in enumerate(messages):
        assert f"This rank expects rank {1 - rank}: sends nothing, receives [" in message
        assert f"rank {1 - rank} announced: sends [activations" in message


@pytest.mark.parametrize("path", ["shm", "gloo"])
def test_all_to_all_split_mismatch_names_the_pair_on_every_rank(path):
    env = {} if path == "shm" else {"ZEROTRAIN_SHM": "0"}
    messages = run_distributed(_mismatched_pair, 2, "splits", timeout=60, env=env)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: ")
        assert "rank 0 sends 2 rows to rank 1, which expects 3" in message
        assert "rank 1 sends 1 rows to rank 0, which expects 2" in message
        assert "the split sizes disagree" in message


def _absent_peer() -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=1))
    if comm.rank == 1:
        time.sleep(2.5)  # never issues the matching send
        return "slept"
    start = time.monotonic()
    try:
        comm.recv(torch.empty(4), 1, purpose="activations")
    except CollectiveError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("verify", ["1", "0"])
def test_peer_that_never_sends_times_out_naming_it(verify, path):
    env = {"ZEROTRAIN_VERIFY_COLLECTIVES": verify, **PATHS[path]}
    out = run_distributed(
        _absent_peer, 2, timeout=60, comm_timeout=20, env=env, own_processes=BREAKS_THE_GROUP
    )[0]
    seconds, message = out.split("s: ", 1)
    assert float(seconds) < 2.5
    if path == "shm":
        # Headers travel with every message through the channel, checked or not.
        assert message.startswith(
            "rank 0: rank 1 did not issue the matching point-to-point call within 1 s"
        )
        assert message.endswith("from rank 1 (shared-memory channel)")
    elif verify == "1":
        assert message.startswith(
            "rank 0: rank 1 did not issue the matching point-to-point call within 1 s"
        )
        assert "recv of activations ((4,) float32, 16 bytes) from rank 1" in message
    else:
        assert message.startswith(
            "rank 0: recv of activations ((4,) float32, 16 bytes) from rank 1 failed"
        )
        assert "The peer probably exited" in message


def _sub_group() -> dict[str, object]:
    odd = dist.new_group([1, 3])
    even = dist.new_group([0, 2])
    comm = Communicator(odd if dist.get_rank() % 2 else even)
    rank = comm.rank  # 0 or 1 within the pair
    mine = torch.full((3,), float(dist.get_rank()))
    theirs = torch.empty(3)
    comm.exchange(
        [
            P2POp.send(mine, 1 - rank, purpose="activations"),
            P2POp.recv(theirs, 1 - rank, purpose="activations"),
        ]
    )
    rows = torch.arange(3, dtype=torch.float32) + 10 * dist.get_rank()
    splits = [1, 2] if rank == 0 else [2, 1]  # the same both ways: in_0[1] == out_1[0] == 2
    got = torch.empty(3)
    comm.all_to_all(
        got, rows, input_split_sizes=splits, output_split_sizes=splits, purpose="tokens"
    )
    bad_peer = "no error"
    try:
        comm.send(mine, 2, purpose="activations")  # a global rank, not a group rank
    except ValueError as err:
        bad_peer = str(err)
    dist.destroy_process_group(odd)
    dist.destroy_process_group(even)
    return {"theirs": theirs.tolist(), "a2a": got.tolist(), "bad_peer": bad_peer}


def test_sub_group_peers_are_group_ranks():
    results = run_distributed(_sub_group, 4)
    for rank, out in enumerate(results):
        partner = rank ^ 2  # the other member of this rank's pair
        assert out["theirs"] == [float(partner)] * 3
        assert "peer 2 is not a rank of this group (ranks 0..1)" in out["bad_peer"]
    # Group rank 0 (global 0 or 1) keeps its first row and gets its partner's first two.
    assert results[0]["a2a"] == [0.0, 20.0, 21.0]
    assert results[2]["a2a"] == [1.0, 2.0, 22.0]
