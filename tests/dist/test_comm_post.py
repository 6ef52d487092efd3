"""The pipeline's one point-to-point entry point, ``Communicator.post_in_order``.

A pipeline stage sends its activations and then waits for gradients from the same peer
that is itself sending gradients and waiting for activations; with a send that waited for
its receive, both would block, so posting returns at once with a handle per message.

NCCL matches the messages of a pair by posting order, whatever their tags. Over gloo, by
default (what users' CPU jobs do), messages to a peer on the same machine go through the
shared-memory mailbox (matched by order, each checked by its header; a send completes
without its receiver) and messages to other machines match by tag over TCP
(``Communicator(shared_memory=False)`` stands for those here); ``ZEROTRAIN_P2P_MATCH=order``
sends everything over gloo by order under one tag, as NCCL does, with a header before each
message that the receiver checks: the suite runs the pipeline in that mode. In both
checking paths a mis-ordered message fails naming both ranks and both messages.
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
    comm = Communicator(shared_memory=False)  # as between two machines: gloo over TCP
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


def test_tag_mode_over_tcp_matches_by_tag_and_sends_do_not_wait():
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


def _receives_out_of_order(mode: str) -> str:
    comm = Communicator(timeout=datetime.timedelta(seconds=5))
    with _matching(mode):
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
            op = P2POp.recv(torch.empty(4), 0, purpose="activations", label="F1")
            comm.post_in_order([op])[0].wait()  # order mode: already at posting
        except CollectiveError as err:
            return str(err)
        return "no error"


@pytest.mark.parametrize("mode", ["tag", "order"])  # the mailbox; gloo under one tag
def test_a_mis_order_names_both_ranks_and_messages(mode):
    message = run_distributed(
        _receives_out_of_order, 2, mode, timeout=60, own_processes=BREAKS_THE_GROUP
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
    comm = Communicator(timeout=datetime.timedelta(seconds=2), shared_memory=mode != "tcp")
    mode = "tag" if mode == "tcp" else mode
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


@pytest.mark.parametrize("mode", ["tag", "tcp", "order"])
def test_a_receive_whose_send_never_comes_fails_by_name(mode):
    message = run_distributed(
        _receive_never_sent, 2, mode, timeout=60, own_processes=BREAKS_THE_GROUP
    )[1]
    assert "rank 1" in message, message
    assert "rank 0" in message, message
    assert "activations" in message, message


def _mailbox_sends_complete_without_their_receiver() -> list[object]:
    comm = Communicator()
    peer = 1 - comm.rank
    mine = [torch.full((4096,), float(10 * comm.rank + k)) for k in range(3)]
    got = [torch.empty(4096) for _ in range(3)]
    with _matching("tag"):
        # The lower rank creates the pair's channel on first use; a first message opens it.
        out, into = torch.zeros(1), torch.empty(1)
        for handle in comm.post_in_order(
            [P2POp.send(out, peer, purpose="warm-up"), P2POp.recv(into, peer, purpose="warm-up")]
        ):
            handle.wait()
        comm.barrier()
        # Each rank posts its three sends one by one (tags reversed: the mailbox matches by
        # order), and they complete at once: the peer has not received yet.
        sends = [
            comm.post_in_order([P2POp.send(t, peer, purpose="activations", tag=9 - k)])[0]
            for k, t in enumerate(mine)
        ]
        done_at_once = all(handle.done() for handle in sends)
        for handle in sends:
            handle.wait()
        for t in mine:
            t.fill_(-1.0)  # a completed send's tensor may change: its data is on its way
        comm.barrier()  # both sent everything before either receives
        recvs = [
            comm.post_in_order([P2POp.recv(g, peer, purpose="activations", tag=k)])[0]
            for k, g in enumerate(got)
        ]
        for handle in recvs:
            handle.wait()
    return [done_at_once, [float(t[0]) for t in got], comm.open_p2p_channels]


def test_mailbox_sends_complete_at_once_and_match_by_order():
    results = run_distributed(_mailbox_sends_complete_without_their_receiver, 2, timeout=60)
    assert results[0][:2] == [True, [10.0, 11.0, 12.0]]
    assert results[1][:2] == [True, [0.0, 1.0, 2.0]]
    assert results[0][2] == 0  # its own channels, not the rendezvous channels of exchange()


def _mailbox_crossing_messages_larger_than_its_slots() -> list[float]:
    comm = Communicator()
    peer = 1 - comm.rank
    n = 3 * (1 << 20)  # 12 MiB of float32: more than a direction's 4 slots of 1 MiB
    mine = torch.arange(n, dtype=torch.float32) + comm.rank
    got = torch.empty(n)
    with _matching("tag"):
        # Both ranks send first, in separate posts: neither send fits, and each finishes
        # while its rank waits for the peer's message.
        send = comm.post_in_order([P2POp.send(mine, peer, purpose="activations")])[0]
        recv = comm.post_in_order([P2POp.recv(got, peer, purpose="activations")])[0]
        recv.wait()
        send.wait()
    return [float((got - torch.arange(n, dtype=torch.float32)).sum() / n)]


def test_mailbox_moves_crossing_messages_larger_than_its_slots():
    results = run_distributed(_mailbox_crossing_messages_larger_than_its_slots, 2, timeout=60)
    assert results == [[1.0], [0.0]]


def _abandoned_peer() -> tuple[str, float]:
    comm = Communicator(timeout=datetime.timedelta(seconds=30))
    with _matching("tag"):
        if comm.rank == 0:
            # Its step failed before it sent: it says so, and stays alive.
            comm.post_in_order([P2POp.send(torch.zeros(8), 1, purpose="warm-up")])[0].wait()
            comm.abandon_posted("RuntimeError: stage 0 refused its output")
            time.sleep(4)
            return "", 0.0
        comm.post_in_order([P2POp.recv(torch.zeros(8), 0, purpose="warm-up")])[0].wait()
        start = time.monotonic()
        try:
            comm.post_in_order([P2POp.recv(torch.empty(8), 0, purpose="activations")])[0].wait()
        except CollectiveError as err:
            return str(err), time.monotonic() - start
        return "no error", time.monotonic() - start


def test_a_peer_that_abandons_its_step_ends_the_waits_on_it_at_once():
    message, waited = run_distributed(
        _abandoned_peer, 2, timeout=60, own_processes=BREAKS_THE_GROUP
    )[1]
    assert "rank 0 abandoned its step: RuntimeError: stage 0 refused its output" in message
    assert "rank 1" in message, message
    assert "activations" in message, message
    assert waited < 3.0, waited  # not the 30 s timeout


def test_posting_to_oneself_is_refused():
    op = P2POp.recv(torch.empty(1), 0, purpose="x")
    with pytest.raises(ValueError, match="this rank"):
        check_ops([op], 0, 2)


def test_an_unknown_matching_mode_is_refused(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_P2P_MATCH", "tags")
    with pytest.raises(ValueError, match="'tag' or 'order'"):
        match_mode()
