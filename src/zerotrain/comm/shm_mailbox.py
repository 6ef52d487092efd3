"""A mailbox for point-to-point messages between CPU ranks on one machine: a send does not
wait for its receive.

``Communicator.post_in_order`` (the pipeline's entry point) posts its messages and returns;
the receiver waits for one when it needs it. Over gloo a message crosses TCP on loopback
and a waiting receiver wakes ~0.45 ms after the send was posted (benchmarks/RESULTS.md,
2026-11-28); the pairwise channel of ``shm_p2p.py`` is a plain copy, but
``PeerToPeer.exchange`` uses it as a rendezvous (both sides in the call at once), which would
make every send wait for its receiver. The mailbox uses a second set of those channels as
rings:

- a send copies its message into the pair's free slots at once and completes when all of it
  is there (its tensor may then change); what does not fit stays queued on this rank and
  moves whenever this rank posts, waits for, or polls (``done()``) any mailbox message;
- a receive copies the message out of the slots; one stream per direction, so messages
  between two ranks match in the order each posts them, as NCCL matches them;
- each message starts with a header (purpose, label, shape, dtype: ``P2POp.entry``), which
  the receiver checks before a byte lands in its tensor, so a mis-ordered message fails on
  the receiver naming both ranks and both messages.

Progress is made only inside this rank's calls (no helper thread competing with the
compute for a core). A send larger than the free slots therefore finishes in a later call;
callers that post in an order NCCL can run (the pipeline's plan) wait for a message only
after posting everything it depends on, and every wait moves every queued message, so
nothing waits on a send that is not moving. A rank whose step fails calls
:meth:`Mailbox.abandon`: its peers' waits on it raise within ~0.1 s, quoting its reason,
instead of lasting the timeout. Waits also end, naming the peer, when it exited, when its
heartbeat stood still for ``ZEROTRAIN_HEARTBEAT_TIMEOUT``, or after the communicator's
timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from zerotrain.comm import liveness
from zerotrain.comm.handle import CollectiveError
from zerotrain.comm.shm_p2p import PairChannel, PeerStalledError, ShmPairs, pause

#: Slots per direction of a mailbox channel (as the exchange channel's: 8 MiB a pair at the
#: default 1 MiB slots, which matters under a small /dev/shm such as Docker's 64 MB).
MAILBOX_SLOTS = 4
_CHECK_S = 0.1  # seconds between looks at a silent peer's state while waiting
_SPINS = 64  # polls before a waiting rank starts yielding its core


class MailboxMessage:
    """One message through the mailbox: what ``Handle`` waits on (``is_completed`` /
    ``wait``, as a backend's work).

    Args:
        box: the mailbox that moves it.
        kind: ``"send"`` or ``"recv"``.
        peer: the other rank, in the communicator's group.
        header: a send's encoded header; a receive's buffer for the peer's.
        data: the tensor's bytes (uint8, contiguous).
        check: a receive's header check (raises on a mismatch).
        entry: what the message carries, for error messages.
    """

    def __init__(
        self,
        box: Mailbox,
        kind: Literal["send", "recv"],
        peer: int,
        header: torch.Tensor,
        data: torch.Tensor,
        check: Callable[[torch.Tensor], None] | None,
        entry: str,
    ) -> None:
        self.box = box
        self.kind = kind
        self.peer = peer
        self.parts = (header, data)
        self.check = check
        self.entry = entry
        self.total = header.numel() + data.numel()
        self.moved = 0  # bytes of header + data through the slots so far
        self.finished = False

    def is_completed(self) -> bool:
        """Whether it moved entirely (moves what it can first; a failed mailbox counts
        as done, and ``wait`` raises)."""
        if not self.finished and self.box.failure is None:
            with contextlib.suppress(CollectiveError):
                self.box.progress()
        return self.finished or self.box.failure is not None

    def wait(self, timeout: object = None) -> bool:
        """Move messages until this one is through (the mailbox's own limits apply;
        ``timeout`` is the communicator's, which the channels already carry)."""
        self.box.wait_for(self)
        return True


def _spans(message: MailboxMessage, n: int) -> Iterator[tuple[torch.Tensor, slice, slice]]:
    """The next ``n`` bytes of ``message`` (header, then data) by part: the part, the
    slice of it, and the slice of the slot they occupy."""
    start, pos = message.moved, 0
    for part in message.parts:
        lo, hi = max(start, pos), min(start + n, pos + part.numel())
        if lo < hi:
            yield part, slice(lo - pos, hi - pos), slice(lo - start, hi - start)
        pos += part.numel()


class Mailbox:
    """The queued messages of one communicator's rank to its peers on this machine.

    Args:
        pairs: the channels (a set used by nothing else: see ``ShmPairs.sibling``).
        name: how messages name a rank of the group.
    """

    def __init__(self, pairs: ShmPairs, name: Callable[[int], str]) -> None:
        self.pairs = pairs
        self._name = name
        self._queues: dict[tuple[int, str], deque[MailboxMessage]] = {}
        self.failure: CollectiveError | None = None  # once set, every call raises it

    def carries(self, peer: int, tensor: torch.Tensor) -> bool:
        """Whether a message of ``tensor`` to or from ``peer`` goes through the mailbox."""
        return self.pairs.is_local(peer) and tensor.device.type == "cpu"

    def post(self, messages: Sequence[MailboxMessage]) -> None:
        """Queue ``messages`` (in order) and move what can move now."""
        self._raise_if_failed()
        for message in messages:
            self._queues.setdefault((message.peer, message.kind), deque()).append(message)
        self.progress()

    def progress(self) -> bool:
        """Move what the peers allow now; True if anything moved.

        Raises:
            CollectiveError: a received header differs from the one expected.
        """
        self._raise_if_failed()
        moved = False
        for (peer, kind), queue in self._queues.items():
            if not queue:
                continue
            channel = self.pairs.channel(peer)
            if channel is None:  # the peer has not created the channel yet
                continue
            move = self._push if kind == "send" else self._pull
            while queue:
                message = queue[0]
                try:
                    moved |= move(channel, message)
                except CollectiveError as err:
                    raise self._fail(err) from None
                if message.moved < message.total:
                    break
                message.finished = True
                queue.popleft()
        return moved

    def wait_for(self, message: MailboxMessage) -> None:
        """Move messages until ``message`` is through.

        Raises:
            CollectiveError: the peer abandoned its step, exited, fell silent or did not
                move within the timeout; a header that differs from the one expected.
        """
        if message.finished:
            return
        now = time.monotonic()
        last_moved, next_check, spins = now, now + _CHECK_S, 0
        with liveness.waiting():
            while True:
                if self.progress():
                    last_moved, spins = time.monotonic(), 0
                if message.finished:
                    return
                spins += 1
                now = time.monotonic()
                if spins > _SPINS:
                    pause(now - last_moved)
                if now >= next_check:
                    next_check = now + _CHECK_S
                    self._check_peer(message, now - last_moved, now)

    def abandon(self, reason: str) -> None:
        """Give up on every channel (a step failed: the streams are out of step): the peers
        waiting on this rank raise, quoting ``reason``; later calls here raise too."""
        if self.failure is None:
            self.failure = CollectiveError(f"the mailbox was abandoned earlier: {reason}")
        for peer in {peer for peer, _ in self._queues} | set(self.pairs.opened_peers()):
            channel = self.pairs.channel(peer)
            if channel is not None:
                channel.abandon(f"{self._name(self.pairs.rank)} abandoned its step: {reason}")
        self._queues.clear()

    def _check_peer(self, message: MailboxMessage, waited: float, now: float) -> None:
        me, peer = self._name(self.pairs.rank), self._name(message.peer)
        what = f"this rank waits to {message.kind} {message.entry} (shared-memory mailbox)"
        channel = self.pairs.channel(message.peer)
        reason = channel.peer_abandoned() if channel is not None else None
        if reason is not None:
            raise self._fail(CollectiveError(f"{me}: {reason}; {what}"))
        try:
            stage = "header" if message.moved == 0 else "data"
            self.pairs.check_peer(message.peer, channel, stage, waited, now)
        except PeerStalledError as err:
            if err.exited:
                state = f"{peer} exited"
            elif err.silent:
                state = f"{peer} stopped answering ({err.silent})"
            else:
                state = (
                    f"{peer} did not move the matching message within {self.pairs.timeout:g} "
                    "s (it is stuck, or took another code path)"
                )
            raise self._fail(CollectiveError(f"{me}: {state}; {what}")) from err

    def _fail(self, err: CollectiveError) -> CollectiveError:
        self.failure = err
        return err

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _push(self, channel: PairChannel, message: MailboxMessage) -> bool:
        """Copy the next chunks of a send into free slots."""
        moved = False
        while message.moved < message.total and channel.free_slots() > 0:
            n = min(channel.settings.slot_bytes, message.total - message.moved)
            slot = channel.next_write_slot()
            for part, in_part, in_slot in _spans(message, n):
                slot[in_slot].copy_(part[in_part])
            message.moved += n
            channel.commit_write()
            moved = True
        return moved

    def _pull(self, channel: PairChannel, message: MailboxMessage) -> bool:
        """Copy the next posted chunks of a receive out of the slots, checking the header
        before any data lands."""
        moved = False
        header = message.parts[0]
        while message.moved < message.total and channel.ready_chunks() > 0:
            n = min(channel.settings.slot_bytes, message.total - message.moved)
            slot = channel.next_read_slot()
            for part, in_part, in_slot in _spans(message, n):
                part[in_part].copy_(slot[in_slot])
                if part is header and in_part.stop == header.numel() and message.check:
                    message.check(header)
            message.moved += n
            channel.commit_read()
            moved = True
        return moved
