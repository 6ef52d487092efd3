"""Pure helpers of the point-to-point and all-to-all operations: split arithmetic, the
pairwise header, op checks, and the comms logger's names for the new operations."""

from __future__ import annotations

import zlib

import pytest
import torch

from zerotrain.comm.comms_logger import bus_factor, canonical_op
from zerotrain.comm.p2p import (
    HEADER_BYTES,
    P2POp,
    check_ops,
    decode_header,
    encode_header,
    expected_text,
    header_text,
    mismatch_message,
)
from zerotrain.comm.splits import check_tensors, resolve_splits, split_mismatches
from zerotrain.comm.stats import CommStats


def test_resolve_splits_even_and_uneven() -> None:
    assert resolve_splits(None, 6, 3, "input_split_sizes") == [2, 2, 2]
    assert resolve_splits([0, 5, 1], 6, 3, "input_split_sizes") == [0, 5, 1]
    assert resolve_splits([0, 0], 0, 2, "output_split_sizes") == [0, 0]


@pytest.mark.parametrize(
    ("splits", "rows", "message"),
    [
        (None, 7, "dim 0 (7 rows) must divide evenly among 3 ranks"),
        ([1, 2], 3, "has 2 entries, expected one per rank (3)"),
        ([1, -1, 3], 3, "must be non-negative ints"),
        ([1.0, 1, 1], 3, "must be non-negative ints"),
        ([1, 1, 2], 3, "[1, 1, 2] sum to 4, but the tensor has 3 rows"),
    ],
)
def test_resolve_splits_refuses_with_the_argument_named(splits, rows, message) -> None:
    with pytest.raises(ValueError, match="input_split_sizes") as info:
        resolve_splits(splits, rows, 3, "input_split_sizes")
    assert message in str(info.value)


def test_split_mismatches_name_every_disagreeing_pair() -> None:
    sends = [[1, 2], [3, 0]]
    assert split_mismatches(sends, [[1, 3], [2, 0]]) == []
    assert split_mismatches(sends, [[1, 3], [4, 0]]) == [
        "rank 0 sends 2 rows to rank 1, which expects 4"
    ]


def test_check_tensors_wants_matching_rows() -> None:
    check_tensors(torch.empty(0, 3), torch.empty(5, 3))
    with pytest.raises(ValueError, match="rows differ"):
        check_tensors(torch.empty(4, 3), torch.empty(4, 2))
    with pytest.raises(ValueError, match="must match"):
        check_tensors(torch.empty(4), torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="0-d"):
        check_tensors(torch.empty(()), torch.empty(()))
    with pytest.raises(ValueError, match="contiguous"):
        check_tensors(torch.empty(4, 4).t(), torch.empty(4, 4))


def test_header_round_trip_and_truncation() -> None:
    text = "sends [activations ((4,) float32, 16 bytes)], receives nothing"
    header = encode_header(text)
    assert header.dtype == torch.uint8
    assert header.numel() == HEADER_BYTES
    assert decode_header(header)[1] == text
    long = "x" * 2000
    crc, shown = decode_header(encode_header(long))
    assert shown == long[: HEADER_BYTES - 8]
    assert crc == zlib.crc32(long.encode())  # the CRC still covers all of it
    assert decode_header(torch.zeros(HEADER_BYTES, dtype=torch.uint8)) is None


def test_headers_of_a_matching_pair_agree() -> None:
    x, y = torch.empty(4), torch.empty(2, 3, dtype=torch.bfloat16)
    # rank 0 sends x to rank 1 and receives y from it; rank 1 does the opposite.
    rank0 = [P2POp.send(x, 1, purpose="act", label="mb0"), P2POp.recv(y, 1, purpose="grad")]
    rank1 = [P2POp.recv(x, 0, purpose="act", label="mb0"), P2POp.send(y, 0, purpose="grad")]
    assert header_text(rank0, 1) == expected_text(rank1, 0)
    assert header_text(rank1, 0) == expected_text(rank0, 1)
    assert (
        mismatch_message(
            "rank 1", "rank 0", expected_text(rank1, 0), encode_header(header_text(rank0, 1))
        )
        is None
    )


def test_mismatch_message_quotes_both_sides() -> None:
    mine = [P2POp.recv(torch.empty(5), 0, purpose="act")]
    theirs = encode_header(header_text([P2POp.send(torch.empty(4), 1, purpose="act")], 1))
    message = mismatch_message("rank 1", "rank 0", expected_text(mine, 0), theirs)
    assert message is not None
    assert (
        "This rank expects rank 0: sends [act ((5,) float32, 20 bytes)], receives nothing"
        in message
    )
    assert "rank 0 announced: sends [act ((4,) float32, 16 bytes)], receives nothing" in message
    garbage = torch.ones(HEADER_BYTES, dtype=torch.uint8)
    assert "not a p2p header" in mismatch_message("rank 1", "rank 0", "x", garbage)


def test_check_ops_refuses_bad_peers_and_layouts() -> None:
    t = torch.empty(4)
    check_ops([P2POp.send(t, 1, purpose="a"), P2POp.recv(t, 2, purpose="a")], 0, 3)
    with pytest.raises(ValueError, match="peer 3 is not a rank of this group"):
        check_ops([P2POp.send(t, 3, purpose="a")], 0, 3)
    with pytest.raises(ValueError, match="peer 0 is this rank"):
        check_ops([P2POp.recv(t, 0, purpose="a")], 0, 3)
    with pytest.raises(ValueError, match="contiguous"):
        check_ops([P2POp.send(torch.empty(3, 3).t(), 1, purpose="a")], 0, 3)


def test_new_ops_are_counted_and_logged_by_name() -> None:
    stats = CommStats()
    stats.record("send", "act", 16)
    stats.record("recv", "act", 16)
    stats.record("all_to_all", "tokens", 64)
    snap = stats.snapshot()
    assert (snap.get("send").bytes, snap.get("recv").bytes, snap.get("all_to_all").bytes) == (
        16,
        16,
        64,
    )
    assert canonical_op("all_to_all_single") == "all_to_all"
    assert canonical_op("isend") == "send"
    assert canonical_op("batch_isend_irecv") == "send_recv"
    assert bus_factor("all_to_all", 4) == pytest.approx(0.75)
    assert bus_factor("send_recv", 4) == 1.0
