"""Posted point-to-point messages: tagged, never waiting for the receiver.

A pipeline stage sends its activations and then waits for gradients from the same peer
that is itself sending gradients and waiting for activations; with a send that waited for
its receive, both would block. ``Communicator.post`` returns at once, and messages match by
tag, so the order of posting between two ranks does not matter.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
from zerotrain.comm.p2p import P2POp, check_ops
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed


def _crossing_sends_and_reordered_tags() -> list[list[float]]:
    comm = Communicator()
    peer = 1 - comm.rank
    mine = [torch.full((3,), float(10 * comm.rank + k)) for k in range(3)]
    got = [torch.empty(3) for _ in range(3)]
    # Both ranks send first and receive afterwards (each wait follows its own send), and
    # rank 1 posts its receives in reverse tag order.
    sends = [
        comm.post([P2POp.send(t, peer, purpose="activations", tag=k)]) for k, t in enumerate(mine)
    ]
    order = range(3) if comm.rank == 0 else reversed(range(3))
    recvs = {k: comm.post([P2POp.recv(got[k], peer, purpose="activations", tag=k)]) for k in order}
    for k in range(3):
        recvs[k].wait()
    for handle in sends:
        handle.wait()
    stats = comm.snapshot()
    assert stats.get(op="send", purpose="activations").calls == 3
    assert stats.get(op="recv", purpose="activations").payload_bytes == 3 * 3 * 4
    return [float(t[0]) for t in got]


def test_posted_messages_match_by_tag_and_sends_do_not_wait():
    results = run_distributed(_crossing_sends_and_reordered_tags, 2, timeout=60)
    assert results[0] == [10.0, 11.0, 12.0]
    assert results[1] == [0.0, 1.0, 2.0]


def _non_float_dtypes() -> list[list[object]]:
    comm = Communicator()
    values = [torch.tensor([True, False, True]), torch.arange(4, dtype=torch.int64) * 7]
    if comm.rank == 0:
        comm.post(
            [P2POp.send(v, 1, purpose="activations", tag=i) for i, v in enumerate(values)]
        ).wait()
        return []
    got = [torch.empty_like(v) for v in values]
    comm.post([P2POp.recv(g, 0, purpose="activations", tag=i) for i, g in enumerate(got)]).wait()
    return [g.tolist() for g in got]


def test_bool_and_integer_tensors_cross_as_themselves():
    results = run_distributed(_non_float_dtypes, 2, timeout=60)
    assert results[1] == [[True, False, True], [0, 7, 14, 21]]


def _receive_never_sent() -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=2))
    if comm.rank == 1:
        try:
            comm.post([P2POp.recv(torch.empty(2), 0, purpose="activations", tag=5)]).wait()
        except CollectiveError as err:
            message = str(err)
        else:
            message = "no error"
    else:
        message = ""
        time.sleep(4)  # alive past the peer's timeout: it fails by waiting, not by a hang-up
    return message


def test_a_receive_whose_send_never_comes_fails_by_name():
    message = run_distributed(_receive_never_sent, 2, timeout=60, own_processes=BREAKS_THE_GROUP)[1]
    assert "rank 1" in message, message
    assert "recv of activations" in message, message


def test_posting_to_oneself_is_refused():
    op = P2POp.recv(torch.empty(1), 0, purpose="x")
    with pytest.raises(ValueError, match="this rank"):
        check_ops([op], 0, 2)
