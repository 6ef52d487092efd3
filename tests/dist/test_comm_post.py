"""The pipeline's one point-to-point entry point, ``Communicator.post_in_order``.

A pipeline stage sends its activations and then waits for gradients from the same peer
that is itself sending gradients and waiting for activations; with a send that waited for
its receive, both would block, so posting returns at once with a handle per message.

NCCL matches the messages of a pair by posting order, whatever their tags. Over gloo,
``ZEROTRAIN_P2P_MATCH=tag`` matches by tag (what users' CPU jobs do by default) and
``ZEROTRAIN_P2P_MATCH=order`` by order under one tag, as NCCL does, with a header before
each message that the receiver checks: the suite runs the pipeline in that mode, and a
mis-ordered message fails naming both ranks and both messages.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator

import pytest
import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.comm.handle import CollectiveError
from zerotrain.comm.p2p import P2POp, check_ops, match_mode
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed


@contextlib.contextmanager
def _matching(mode: str) -> Iterator[None]:
    """``ZEROTRAIN_P2P_MATCH=mode`` for the block (read at each post), restored after."""
    before = os.environ.get("ZEROTRAIN_P2P_MATCH")
    os.environ["ZEROTRAIN_P2P_MATCH"] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ["ZEROTRAIN_P2P_MATCH"]
        else:
            os.environ["ZEROTRAIN_P2P_MATCH"] = before


def _crossing_sends_and_reordered_tags() -> list[list[float]]:
    comm = Communicator()
    peer = 1 - comm.rank
    mine = [torch.full((3,), float(10 * comm.rank + k)) for k in range(3)]
    got = [torch.empty(3) for _ in range(3)]
    with _matching("tag"):
        # Both ranks send first and receive afterwards (each wait follows its own send),
        # and rank 1 posts its receives in reverse tag order: tags decide.
        sends = [
            comm.post_in_order([P2POp.send(t, peer, purpose="activations", tag=k)])[0]
            for k, t in enumerate(mine)
        ]
        order = range(3) if comm.rank == 0 else reversed(range(3))
        recvs = {
            k: comm.post_in_order([P2POp.recv(got[k], peer, purpose="activations", tag=k)])[0]
            for k in order
        }
    for k in range(3):
        recvs[k].wait()
    for handle in sends:
        handle.wait()
    stats = comm.snapshot()
    assert stats.get(op="send", purpose="activations").calls == 3
    assert stats.get(op="recv", purpose="activations").payload_bytes == 3 * 3 * 4
    return [float(t[0]) for t in got]


def test_tag_mode_matches_by_tag_and_sends_do_not_wait():
    results = run_distributed(_crossing_sends_and_reordered_tags, 2, timeout=60)
    assert results[0] == [10.0, 11.0, 12.0]
    assert results[1] == [0.0, 1.0, 2.0]


def _order_mode_ignores_tags() -> list[float]:
    comm = Communicator()
    peer = 1 - comm.rank
    mine = [torch.full((1000,), float(10 * comm.rank + k)) for k in range(3)]
    got = [torch.empty(1000) for _ in range(3)]
    with _matching("order"):
        # One batch each, sends and receives of both directions together (as a 1F1B stage
        # posts its activations with the gradients it expects); the receives' tags differ
        # from the sends' and run backwards: only the order counts.
        ops = [
            P2POp.send(t, peer, purpose="activations", label=f"F{k}", tag=k)
            for k, t in enumerate(mine)
        ] + [
            P2POp.recv(g, peer, purpose="activations", label=f"F{k}", tag=9 - k)
            for k, g in enumerate(got)
        ]
        handles = comm.post_in_order(ops)
    assert len(handles) == len(ops)
    for handle in handles:
        handle.wait()
    return [float(t[0]) for t in got]


def test_order_mode_matches_by_posting_order_whatever_the_tags():
    results = run_distributed(_order_mode_ignores_tags, 2, timeout=60)
    assert results[0] == [10.0, 11.0, 12.0]
    assert results[1] == [0.0, 1.0, 2.0]


def _receives_out_of_order() -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=5))
    with _matching("order"):
        if comm.rank == 0:
            handles = comm.post_in_order(
                [
                    P2POp.send(torch.zeros(4), 1, purpose="activations", label="F0"),
                    P2POp.send(torch.ones(4), 1, purpose="activations", label="F1"),
                ]
            )
            time.sleep(3)  # alive while the peer checks; its data is never received
            del handles
            return ""
        try:
            # Same shapes, same dtype: matched by order, F1's buffer would get F0's values.
            comm.post_in_order([P2POp.recv(torch.empty(4), 0, purpose="activations", label="F1")])
        except CollectiveError as err:
            return str(err)
        return "no error"


def test_order_mode_names_both_ranks_and_messages_of_a_mis_order():
    message = run_distributed(
        _receives_out_of_order, 2, timeout=60, own_processes=BREAKS_THE_GROUP
    )[1]
    assert "rank 1" in message, message
    assert "rank 0" in message, message
    assert "[F1]" in message, message
    assert "[F0]" in message, message
    assert "different orders" in message, message


def _non_float_dtypes(mode: str) -> list[list[object]]:
    comm = Communicator()
    values = [torch.tensor([True, False, True]), torch.arange(4, dtype=torch.int64) * 7]
    with _matching(mode):
        if comm.rank == 0:
            ops = [P2POp.send(v, 1, purpose="activations", tag=i) for i, v in enumerate(values)]
            for handle in comm.post_in_order(ops):
                handle.wait()
            return []
        got = [torch.empty_like(v) for v in values]
        ops = [P2POp.recv(g, 0, purpose="activations", tag=i) for i, g in enumerate(got)]
        for handle in comm.post_in_order(ops):
            handle.wait()
    return [g.tolist() for g in got]


@pytest.mark.parametrize("mode", ["tag", "order"])
def test_bool_and_integer_tensors_cross_as_themselves(mode):
    results = run_distributed(_non_float_dtypes, 2, mode, timeout=60)
    assert results[1] == [[True, False, True], [0, 7, 14, 21]]


def _receive_never_sent(mode: str) -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=2))
    if comm.rank == 1:
        try:
            with _matching(mode):
                op = P2POp.recv(torch.empty(2), 0, purpose="activations", tag=5)
                comm.post_in_order([op])[0].wait()
        except CollectiveError as err:
            message = str(err)
        else:
            message = "no error"
    else:
        message = ""
        time.sleep(4)  # alive past the peer's timeout: it fails by waiting, not by a hang-up
    return message


@pytest.mark.parametrize("mode", ["tag", "order"])
def test_a_receive_whose_send_never_comes_fails_by_name(mode):
    message = run_distributed(
        _receive_never_sent, 2, mode, timeout=60, own_processes=BREAKS_THE_GROUP
    )[1]
    assert "rank 1" in message, message
    assert "rank 0" in message, message
    assert "activations" in message, message


def test_posting_to_oneself_is_refused():
    op = P2POp.recv(torch.empty(1), 0, purpose="x")
    with pytest.raises(ValueError, match="this rank"):
        check_ops([op], 0, 2)


def test_an_unknown_matching_mode_is_refused(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_P2P_MATCH", "tags")
    with pytest.raises(ValueError, match="'tag' or 'order'"):
        match_mode()
