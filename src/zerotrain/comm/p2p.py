"""Point-to-point exchanges: batched sends and receives between pairs of ranks.

A :class:`P2POp` names one tensor to send to, or receive from, one peer (a rank in the
communicator's group). :class:`PeerToPeer` issues a list of them together
(``torch.distributed.batch_isend_irecv``, so a ring exchange in both directions cannot
deadlock), counts each in ``CommStats`` (``send`` / ``recv``), times the batch when the comms
logger profiles it, and returns one :class:`Handle`.

**Pairwise check.** The collective signature check (an all-reduce over the whole group) does
not apply: only two ranks take part. Instead, over gloo, each rank first sends every peer of
the batch a small header describing what it will send that peer and what it expects back
(purpose, label, shape, dtype), and receives the peer's. Each side compares the peer's
header with what its own ops imply, so a mismatched pair (a shape or dtype that differs, a
send met by a send) fails on *both* sides with a :class:`CollectiveError` quoting both,
before any payload moves: gloo would otherwise abort the process on a size mismatch, or
deliver the wrong bytes when sizes agree. A peer that never issues its call is reported by
name after the communicator's timeout. Calls between one pair are matched in order: the
k-th exchange a rank issues involving a peer is checked against the k-th exchange that peer
issues involving it. The header round trip makes issuing wait until each peer issued its
matching call (bounded by the timeout); ``async_op`` overlaps the payload.
``ZEROTRAIN_VERIFY_COLLECTIVES=0`` turns the headers off (set it alike on every rank).

**Same machine.** Peers on this machine (when the communicator has shared memory) swap the
same headers through a pairwise shared-memory channel instead (``shm_p2p.py``), and CPU
messages of at least ``PairSettings.min_bytes`` move through it, a plain copy instead of
gloo's TCP loopback; the rest of the batch goes over gloo as above. Headers always travel
with messages carried in shared memory (they cost a few microseconds there). The channel
copies on the calling thread: a batch with shared-memory messages returns once they moved
(its handle is then complete), still only after each peer issued its matching call.
"""

from __future__ import annotations

import datetime
import functools
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from zerotrain.comm import departures, liveness
from zerotrain.comm.comms_logger import CommsLogger
from zerotrain.comm.handle import (
    CollectiveError,
    Handle,
    Waitable,
    describe_tensor,
    failure_message,
)
from zerotrain.comm.shm_mailbox import MAILBOX_SLOTS, Mailbox, MailboxMessage
from zerotrain.comm.shm_p2p import PairWork, PeerStalledError, ShmPairs
from zerotrain.comm.stats import CommStats
from zerotrain.utils.invariant import invariant

HEADER_BYTES = 512
ORDER_TAG = 0  # the one tag of messages matched by order (their group carries nothing else)
_MAGIC = b"ZTP1"  # a header, version 1 (anything else received is not a header)
_TEXT_START = 8  # magic (4 bytes), CRC-32 of the whole text (4 bytes), then the text

_ORDER_WHY = " (pipeline messages match by order: the two ranks posted them in different orders)"

P2P_HINT = (
    "The peer probably exited, or never issued the matching send/recv (a different code "
    "path); see its output."
)


@dataclass(frozen=True, slots=True)
class P2POp:
    """One tensor to send to, or receive into from, one peer.

    Args:
        kind: ``"send"`` or ``"recv"``.
        tensor: contiguous; a receive overwrites it.
        peer: the other rank, as a rank in the communicator's group.
        purpose: why it moves (``"activations"``, ``"gradients"``, ...), as for collectives.
        label: what it belongs to (e.g. ``"microbatch 3"``), for errors and the comms logger.
        tag: matches a send with a receive over gloo in :meth:`PeerToPeer.post_in_order`
            (``ZEROTRAIN_P2P_MATCH=tag``, the default); ignored where messages match by
            order (NCCL, ``ZEROTRAIN_P2P_MATCH=order``, and :meth:`PeerToPeer.exchange`).
    """

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    purpose: str
    label: str | None = None
    tag: int = 0

    @staticmethod
    def send(
        tensor: torch.Tensor, dst: int, *, purpose: str, label: str | None = None, tag: int = 0
    ) -> P2POp:
        """Send ``tensor`` to group rank ``dst``."""
        return P2POp("send", tensor, dst, purpose, label, tag)

    @staticmethod
    def recv(
        tensor: torch.Tensor, src: int, *, purpose: str, label: str | None = None, tag: int = 0
    ) -> P2POp:
        """Receive into ``tensor`` from group rank ``src``."""
        return P2POp("recv", tensor, src, purpose, label, tag)

    def entry(self) -> str:
        """What this op carries, as both sides of the pair describe it."""
        about = f" [{self.label}]" if self.label else ""
        where = self.tensor.device.type
        on = f" on {where}" if where != "cpu" else ""  # both sides must route alike
        return f"{self.purpose}{about} ({describe_tensor(self.tensor)}{on})"


def match_mode() -> str:
    """How gloo matches the messages of :meth:`PeerToPeer.post_in_order`:
    ``ZEROTRAIN_P2P_MATCH=tag`` (default: by their tags) or ``order`` (by posting order,
    under one tag, as NCCL does; with header checks). NCCL always matches by order.

    Raises:
        ValueError: another value.
    """
    mode = os.environ.get("ZEROTRAIN_P2P_MATCH", "tag").strip().lower() or "tag"
    if mode not in ("tag", "order"):
        raise ValueError(f"ZEROTRAIN_P2P_MATCH must be 'tag' or 'order', got {mode!r}")
    return mode


def check_ops(ops: Sequence[P2POp], rank: int, world_size: int) -> None:
    """Refuse ops no backend could run, naming the op.

    Raises:
        ValueError: a peer outside ``[0, world_size)`` or equal to ``rank``, an unknown
            kind, or a non-contiguous tensor.
    """
    for i, op in enumerate(ops):
        where = f"p2p op {i} ({op.kind} of {op.purpose})"
        if op.kind not in ("send", "recv"):
            raise ValueError(f"{where}: kind must be 'send' or 'recv', got {op.kind!r}")
        if not 0 <= op.peer < world_size:
            raise ValueError(
                f"{where}: peer {op.peer} is not a rank of this group (ranks 0..{world_size - 1})"
            )
        if op.peer == rank:
            raise ValueError(f"{where}: peer {op.peer} is this rank; copy the tensor instead")
        if not op.tensor.is_contiguous():
            raise ValueError(f"{where}: the tensor must be contiguous (call .contiguous())")


def _listing(entries: Sequence[str]) -> str:
    return "[" + "; ".join(entries) + "]" if entries else "nothing"


def header_text(ops: Sequence[P2POp], peer: int) -> str:
    """What this rank tells ``peer``: the ops it has with it, in order, as it sees them."""
    sends = [op.entry() for op in ops if op.peer == peer and op.kind == "send"]
    recvs = [op.entry() for op in ops if op.peer == peer and op.kind == "recv"]
    return f"sends {_listing(sends)}, receives {_listing(recvs)}"


def expected_text(ops: Sequence[P2POp], peer: int) -> str:
    """The header ``peer`` must send for its ops to match this rank's: it sends what this
    rank receives from it, and receives what this rank sends it."""
    sends = [op.entry() for op in ops if op.peer == peer and op.kind == "recv"]
    recvs = [op.entry() for op in ops if op.peer == peer and op.kind == "send"]
    return f"sends {_listing(sends)}, receives {_listing(recvs)}"


def encode_header(text: str) -> torch.Tensor:
    """``text`` as a fixed-size uint8 tensor: magic, CRC-32 of the whole text, then as much
    of the text as fits (the CRC decides a match; the text is for the error message)."""
    raw = text.encode()
    packed = _MAGIC + zlib.crc32(raw).to_bytes(4, "little") + raw[: HEADER_BYTES - _TEXT_START]
    return torch.frombuffer(bytearray(packed.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8)


def decode_header(header: torch.Tensor) -> tuple[int, str] | None:
    """``(crc, text)`` of an encoded header, or None if it is not one."""
    raw = header.numpy().tobytes()
    if raw[: len(_MAGIC)] != _MAGIC:
        return None
    crc = int.from_bytes(raw[len(_MAGIC) : _TEXT_START], "little")
    return crc, raw[_TEXT_START:].rstrip(b"\0").decode(errors="replace")


def mismatch_message(
    me: str,
    peer_name: str,
    expected: str,
    received: torch.Tensor,
    what: str = "point-to-point calls",
    why: str = "",
) -> str | None:
    """The error for a peer whose header differs from ``expected`` (None if it matches);
    ``what`` the two ranks issued, ``why`` that matters (appended)."""
    decoded = decode_header(received)
    if decoded is not None and decoded[0] == zlib.crc32(expected.encode()):
        return None
    actual = "something that is not a p2p header" if decoded is None else decoded[1]
    return (
        f"{me}: the {what} of this rank and {peer_name} do not match (they took "
        f"different code paths, or issued their calls in a different order). This rank "
        f"expects {peer_name}: {expected}; {peer_name} announced: {actual}{why}"
    )


class PeerToPeer:
    """Issues batches of :class:`P2POp` for one ``Communicator`` (its group, counters and
    logger), with the pairwise header check over gloo.

    Args:
        group: the process group (None = the default group).
        rank / world_size: this rank's place in the group.
        to_global: the default-group rank of a group rank (what torch's p2p calls take).
        timeout: how long a wait lasts before raising (None: the backend's watchdog).
        verify: exchange headers before each batch (gloo only).
        stats / logger: the communicator's counters and comms logger.
        pairs: shared-memory channels to the peers on this machine (None: none).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        to_global: Callable[[int], int],
        timeout: datetime.timedelta | None,
        verify: bool,
        stats: CommStats,
        logger: CommsLogger,
        pairs: ShmPairs | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._to_global = to_global
        self.timeout = timeout
        self.verify = verify
        self.stats = stats
        self.logger = logger
        self.pairs = pairs
        self._mailbox: Mailbox | None = None  # opened by the first message it carries

    def _name(self, rank: int) -> str:
        if self.group is None:
            return f"rank {rank}"
        return f"rank {rank} (global rank {self._to_global(rank)})"

    def _describe(self, ops: Sequence[P2POp]) -> str:
        parts = [
            f"{op.kind} of {op.entry()} {'to' if op.kind == 'send' else 'from'} rank {op.peer}"
            for op in ops
        ]
        return f"{self._name(self.rank)}: " + ", ".join(parts)

    def _explain(self, ops: Sequence[P2POp]) -> Callable[[], str]:
        """After a transport error: which of the peers of ``ops`` are gone, with their
        hosts (``liveness.explain_failure``: exit markers, /proc, heartbeats)."""
        peers = sorted({self._to_global(op.peer) for op in ops})
        return lambda: liveness.explain_failure(peers)

    def exchange(self, ops: Sequence[P2POp], *, async_op: bool = False) -> Handle:
        """Issue ``ops`` together; see :meth:`Communicator.exchange`."""
        check_ops(ops, self.rank, self.world_size)
        ops = list(ops)

        def describe() -> str:
            return self._describe(ops)

        if not ops:
            return Handle(None, describe)
        for op in ops:
            self.stats.record(op.kind, op.purpose, op.tensor.numel() * op.tensor.element_size())
        pairs = self.pairs
        peers = {op.peer for op in ops}
        local = {p for p in peers if pairs is not None and pairs.is_local(p)}
        shared = [pairs is not None and pairs.carries(op.peer, op.tensor) for op in ops]
        if self.verify and peers - local:
            self._check_headers(ops, sorted(peers - local))
        # Peers on this machine swap headers through their channel: with every batch when
        # verifying, and always before messages that move there.
        checked = (
            local if self.verify else {op.peer for op, s in zip(ops, shared, strict=True) if s}
        )
        if checked:
            self._run_shared(ops, [self._header_work(ops, peer) for peer in sorted(checked)])
        sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.kind == "send")
        got = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.kind == "recv")
        kinds = {op.kind for op in ops}
        timer = self.logger.start(
            kinds.pop() if len(kinds) == 1 else "send_recv",
            ",".join(sorted({op.purpose for op in ops})),
            max(sent, got),  # nccl-tests' sendrecv: the message size of one direction
            ops[0].tensor.device,
            ops[0].label if len({op.label for op in ops}) == 1 else None,
        )
        backend = [op for op, s in zip(ops, shared, strict=True) if not s]
        works = None
        if backend:
            try:
                works = dist.batch_isend_irecv([self._torch_op(op) for op in backend])
            except Exception as exc:
                message = failure_message(describe(), exc, P2P_HINT, self._explain(ops))
                raise CollectiveError(message) from exc
        if len(backend) < len(ops):
            self._run_shared(ops, _data_works([op for op, s in zip(ops, shared, strict=True) if s]))
        on_done = None
        if timer is not None:
            if works is None:
                timer.stop(overlapped=False)  # finished inside the call (shared memory)
            else:
                on_done = timer.stopping(None, overlapped=async_op)
        handle = Handle(
            works, describe, on_done, self.timeout, hint=P2P_HINT, explain=self._explain(ops)
        )
        if not async_op:
            handle.wait()
        return handle

    def post_in_order(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Issue ``ops`` in order without waiting; see :meth:`Communicator.post_in_order`."""
        check_ops(ops, self.rank, self.world_size)
        ops = list(ops)
        for op in ops:
            self.stats.record(op.kind, op.purpose, op.tensor.numel() * op.tensor.element_size())
        if not ops:
            return []
        backend = str(dist.get_backend(self.group))
        try:
            if backend == "nccl":  # one group: NCCL matches by order, and ignores tags
                works = dist.batch_isend_irecv([self._torch_op(op) for op in ops])
                # A coalescing backend returns one work for the whole group (its ops
                # complete together); one without coalescing, a work per op.
                per_op: list[Sequence[Waitable]] = (
                    [[work] for work in works] if len(works) == len(ops) else [works] * len(ops)
                )
            elif match_mode() == "order":
                per_op = list(self._issue_by_order(ops))
            else:
                per_op = self._issue_by_tag_or_mailbox(ops)
        except CollectiveError:
            raise
        except Exception as exc:
            message = failure_message(self._describe(ops), exc, P2P_HINT, self._explain(ops))
            raise CollectiveError(message) from exc
        return [
            Handle(
                works,
                functools.partial(self._describe, [op]),
                None,
                self.timeout,
                hint=P2P_HINT,
                explain=self._explain([op]),
            )
            for op, works in zip(ops, per_op, strict=True)
        ]

    def abandon_posted(self, reason: str) -> None:
        """A step failed with messages of :meth:`post_in_order` outstanding: tell the peers
        on this machine (their waits on this rank raise at once, quoting ``reason``), and
        every rank through the job's store: a peer blocked on this rank over the network,
        whose wait cannot be interrupted, is ended by its peer watchdog a second into the
        wait, quoting it (``liveness.PeerWatchdog``)."""
        if self._mailbox is not None:
            self._mailbox.abandon(reason)
        departures.announce_abandoned(f"{self._name(self.rank)} abandoned its step: {reason}")

    def _issue_by_tag_or_mailbox(self, ops: Sequence[P2POp]) -> list[Sequence[Waitable]]:
        """Gloo's default: messages to peers on this machine through the mailbox
        (``shm_mailbox.py``), the rest by tag."""
        box = self._mailbox
        if box is None and self.pairs is not None:
            box = self._mailbox = Mailbox(self.pairs.sibling("m", MAILBOX_SLOTS), self._name)
        per_op: list[Sequence[Waitable]] = []
        boxed: list[MailboxMessage] = []
        for op in ops:
            if box is not None and box.carries(op.peer, op.tensor):
                boxed.append(self._mailbox_message(box, op))
                per_op.append([boxed[-1]])
            else:
                per_op.append([self._issue(op, op.tag)])
        if boxed:
            box.post(boxed)  # type: ignore[union-attr]
        return per_op

    def _mailbox_message(self, box: Mailbox, op: P2POp) -> MailboxMessage:
        data = op.tensor.reshape(-1).view(torch.uint8)
        entry = op.entry()
        if op.kind == "send":
            return MailboxMessage(box, "send", op.peer, encode_header(entry), data, None, entry)
        me, peer = self._name(self.rank), self._name(op.peer)

        def check(received: torch.Tensor) -> None:
            problem = mismatch_message(me, peer, entry, received, what="messages", why=_ORDER_WHY)
            if problem is not None:
                raise CollectiveError(problem)

        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        return MailboxMessage(box, "recv", op.peer, header, data, check, entry)

    def _issue(self, op: P2POp, tag: int) -> dist.Work:
        fn = dist.isend if op.kind == "send" else dist.irecv
        work = fn(op.tensor, self._to_global(op.peer), self.group, tag)
        invariant(work is not None, "isend/irecv returned no work for a group member")
        return work  # type: ignore[return-value]

    def _issue_by_order(self, ops: Sequence[P2POp]) -> list[list[dist.Work]]:
        """Gloo matching by order, as NCCL does: every message under one tag. With
        verification, each message is preceded by a header naming it (purpose, label,
        shape, dtype), and a receive checks the header before its data is received: a
        mis-ordered message fails on the receiving rank with both sides' descriptions
        instead of landing in the wrong buffer. Sends go first, so that posting never keeps
        a peer waiting."""
        per_op: dict[int, list[dist.Work]] = {}
        order = sorted(range(len(ops)), key=lambda i: ops[i].kind != "send")
        for i in order:
            op = ops[i]
            works = []
            if op.kind == "send":
                if self.verify:
                    works.append(self._issue_header(op))
                works.append(self._issue(op, ORDER_TAG))
            else:
                if self.verify:
                    self._check_order_header(op)
                works.append(self._issue(op, ORDER_TAG))
            per_op[i] = works
        return [per_op[i] for i in range(len(ops))]

    def _issue_header(self, op: P2POp) -> dist.Work:
        header = encode_header(op.entry())
        return self._issue(P2POp.send(header, op.peer, purpose="header"), ORDER_TAG)

    def _check_order_header(self, op: P2POp) -> None:
        """Receive the header of ``op``'s message and raise, naming both ranks and both
        messages, when the peer announced another one."""
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        work = self._issue(P2POp.recv(header, op.peer, purpose="header"), ORDER_TAG)
        self._wait_for_peer(
            work, op.peer, "post the next message of this pair", lambda: f"waits for {op.entry()}"
        )
        problem = mismatch_message(
            self._name(self.rank),
            self._name(op.peer),
            op.entry(),
            header,
            what="messages",
            why=_ORDER_WHY,
        )
        if problem is not None:
            raise CollectiveError(problem)

    def _header_work(self, ops: Sequence[P2POp], peer: int) -> PairWork:
        """The header swap with ``peer`` through its channel, raising on a mismatch."""
        me, expected = self._name(self.rank), expected_text(ops, peer)

        def check(received: torch.Tensor) -> None:
            problem = mismatch_message(me, self._name(peer), expected, received)
            if problem is not None:
                raise CollectiveError(problem)

        return PairWork(peer, encode_header(header_text(ops, peer)), check)

    def _run_shared(self, ops: Sequence[P2POp], works: Sequence[PairWork]) -> None:
        """Run ``works`` through the shared-memory channels; a late or dead peer becomes a
        :class:`CollectiveError` naming it."""
        invariant(self.pairs is not None, "shared-memory p2p without channels")
        try:
            self.pairs.run(works)  # type: ignore[union-attr]
        except PeerStalledError as err:
            raise CollectiveError(self._stalled_message(ops, err)) from err

    def _stalled_message(self, ops: Sequence[P2POp], err: PeerStalledError) -> str:
        me, peer = self._name(self.rank), self._name(err.peer)
        limit = self.pairs.timeout if self.pairs is not None else err.waited
        doing = self._describe(ops).split(": ", 1)[1]
        if err.exited:
            when = "during" if err.stage == "data" else "before issuing"
            what = f"{peer} exited {when} the matching point-to-point call"
        elif err.silent:
            what = f"{peer} stopped answering ({err.silent})"
        elif err.stage == "header":
            what = (
                f"{peer} did not issue the matching point-to-point call within "
                f"{limit:g} s (it exited, is stuck, or took another code path)"
            )
        else:
            what = f"{peer} stopped moving the data of the matching call for {limit:g} s"
        return f"{me}: {what}; this rank is in {doing} (shared-memory channel)"

    def _torch_op(self, op: P2POp) -> dist.P2POp:
        fn = dist.isend if op.kind == "send" else dist.irecv
        return dist.P2POp(fn, op.tensor, self._to_global(op.peer), group=self.group)

    def _wait_for_peer(
        self, work: dist.Work, peer: int, did_not: str, this_rank: Callable[[], str]
    ) -> None:
        """Wait for a header ``work`` with ``peer``; on a failure or the timeout, raise
        naming both ranks: "<peer> did not <did_not> ...; this rank <this_rank()>"."""
        try:
            with liveness.waiting():
                work.wait(self.timeout) if self.timeout is not None else work.wait()
        except Exception as exc:
            seconds = f" within {self.timeout.total_seconds():g} s" if self.timeout else ""
            gone = liveness.explain_failure([self._to_global(peer)])
            raise CollectiveError(
                f"{self._name(self.rank)}: {self._name(peer)} did not {did_not}{seconds} (it "
                f"exited, is stuck, or took another code path); this rank {this_rank()} "
                f"({exc}).{gone}"
            ) from exc

    def _check_headers(self, ops: Sequence[P2POp], peers: Sequence[int]) -> None:
        """Swap a header over the backend with each of ``peers``; raise on both sides of a
        mismatch."""
        received = {peer: torch.zeros(HEADER_BYTES, dtype=torch.uint8) for peer in peers}
        torch_ops = []
        for peer in peers:
            header = encode_header(header_text(ops, peer))
            torch_ops.append(dist.P2POp(dist.isend, header, self._to_global(peer), self.group))
            torch_ops.append(
                dist.P2POp(dist.irecv, received[peer], self._to_global(peer), self.group)
            )
        me = self._name(self.rank)
        works = dist.batch_isend_irecv(torch_ops)

        def where() -> str:  # only on a failure: describing the batch costs
            return f"is in {self._describe(ops).split(': ', 1)[1]}"

        for i, work in enumerate(works):
            self._wait_for_peer(
                work, peers[i // 2], "issue the matching point-to-point call", where
            )
        for peer in peers:
            problem = mismatch_message(
                me, self._name(peer), expected_text(ops, peer), received[peer]
            )
            if problem is not None:
                raise CollectiveError(problem)


def _data_works(ops: Sequence[P2POp]) -> list[PairWork]:
    """``ops``' tensors as bytes, per peer, each direction in issue order."""
    works: dict[int, PairWork] = {}
    for op in ops:
        work = works.setdefault(op.peer, PairWork(op.peer))
        data = op.tensor.reshape(-1).view(torch.uint8)
        (work.sends if op.kind == "send" else work.recvs).append(data)
    return list(works.values())
