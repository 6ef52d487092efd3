"""Point-to-point through shared memory, for pairs of CPU ranks on one machine.

The arena of ``shm.py`` synchronises every rank of a group; a send/recv involves two. Each
pair of ranks that exchanges a message therefore gets its own segment, created on first use
(a communicator of N ranks never allocates N*(N-1) buffers up front): the lower rank of the
pair creates it, the higher one opens it and removes the name. Per side it holds one cache
line of control (process id, headers posted, chunks posted, chunks consumed) and two header
cells; per direction ``slots`` data slots of ``slot_bytes``.

**Headers.** Every batch a rank issues involving a peer first posts a header in its cell
(what it sends that peer and what it expects back, as the gloo path's header says) and
compares the peer's; the two cells alternate, and a rank cannot post its next header before
reading the peer's current one, so a cell is never overwritten unread. Both sides of a
mismatched pair raise before any payload moves.

**Data.** A message is cut into chunks of at most one slot; the sender copies chunk i into
slot ``i % slots`` once the receiver consumed chunk ``i - slots``, then raises its
``posted`` counter; the receiver copies it out and raises ``consumed``. Every op of a batch
advances whenever its peer allows it (one loop over all of them), so a ring shifting both
ways at once with messages larger than the slots cannot deadlock. Messages between a pair
keep their order (one stream per direction).

Waits are bounded, and liveness does not rest on process ids alone (``liveness.py``): each
side ticks a heartbeat in its control line. A waiting rank reports a peer at once when
``/proc`` shows it exited or a zombie (same PID namespace), after
``ZEROTRAIN_HEARTBEAT_TIMEOUT`` seconds when its heartbeat stands still (SIGSTOP, another
PID namespace, a hang), and after the communicator's timeout when it is alive but never
takes part.
x86-64 only (the flag protocol relies on its memory ordering), as the arena.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import numpy as np
import torch

from zerotrain.comm import liveness
from zerotrain.comm.handle import CollectiveError
from zerotrain.comm.shm import remove_stale_segments, stale_sweepable_name, untracked_segment
from zerotrain.utils.invariant import invariant

_LINE = 64  # control bytes per side: one cache line
_CELL = 512  # bytes per header cell (p2p.HEADER_BYTES)
_DATA_START = 4096  # control lines and cells fit in the first page
# int64 fields of a side's control line
_PID, _HEADERS, _POSTED, _CONSUMED, _HEARTBEAT, _NAMESPACE, _ABANDONED = 0, 1, 2, 3, 4, 5, 6
_PEER_CHECK_S = 0.1

#: Messages of at least this many bytes go through the channel (below: the backend). Chosen
#: from benchmarks/RESULTS.md (2026-11-25, the pairwise channel).
MIN_BYTES = 0
SLOT_BYTES = 1 << 20
SLOTS = 4

# A wait spins first (a message from a running peer is microseconds away), then yields its
# core, and once nothing has moved for _YIELD_S it sleeps _NAP_S between looks: a peer that
# is computing leaves its core to the ranks that compute (with more ranks than cores,
# yielding waiters still took turns on the cores and delayed them).
_YIELD_S = 1e-3
_NAP_S = 1e-4


def pause(quiet_s: float) -> None:
    """Between two looks of a wait in which nothing moved for ``quiet_s`` seconds."""
    time.sleep(_NAP_S if quiet_s > _YIELD_S else 0)


@dataclass(frozen=True, slots=True)
class PairSettings:
    """How channels are sized and when they are used; every rank must use the same.

    Args:
        min_bytes: smallest message that goes through shared memory.
        slot_bytes: bytes per data slot (a message larger than a slot is streamed).
        slots: slots per direction (the sender may run this many chunks ahead).
    """

    min_bytes: int = MIN_BYTES
    slot_bytes: int = SLOT_BYTES
    slots: int = SLOTS

    @staticmethod
    def from_env() -> PairSettings:
        """``ZEROTRAIN_SHM_P2P_MIN_BYTES`` and ``ZEROTRAIN_SHM_P2P_SLOT_BYTES``, else defaults.

        Raises:
            ValueError: a value that is not an integer, or out of range.
        """
        min_bytes = int(os.environ.get("ZEROTRAIN_SHM_P2P_MIN_BYTES", MIN_BYTES))
        slot_bytes = int(os.environ.get("ZEROTRAIN_SHM_P2P_SLOT_BYTES", SLOT_BYTES))
        if min_bytes < 0:
            raise ValueError(f"ZEROTRAIN_SHM_P2P_MIN_BYTES must be >= 0, got {min_bytes}")
        if slot_bytes < _LINE or slot_bytes % _LINE:
            raise ValueError(
                f"ZEROTRAIN_SHM_P2P_SLOT_BYTES must be a positive multiple of {_LINE}, "
                f"got {slot_bytes}"
            )
        return PairSettings(min_bytes, slot_bytes, SLOTS)

    def segment_bytes(self) -> int:
        """Size of one pair's segment."""
        return _DATA_START + 2 * self.slots * self.slot_bytes


class PeerStalledError(RuntimeError):
    """A peer did not take its part in a point-to-point exchange.

    Args:
        peer: its rank in the group.
        stage: ``"header"`` (it never issued the matching call) or ``"data"``.
        exited: its process is gone.
        waited: seconds this rank waited.
    """

    def __init__(
        self, peer: int, stage: str, exited: bool, waited: float, silent: str | None = None
    ) -> None:
        state = "exited" if exited else "stopped answering" if silent else "is late"
        super().__init__(f"rank {peer} {state} ({stage})")
        self.peer = peer
        self.stage = stage
        self.exited = exited
        self.waited = waited
        self.silent = silent  # how its heartbeat fell silent, when it did


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def _gone(state: str) -> bool:
    """Whether a ``liveness.process_state`` says the process is gone."""
    return state == "exited" or state.startswith("a zombie")


class PairChannel(liveness.Tickable):
    """One pair's segment, seen from one side (0: the lower rank, which created it)."""

    def __init__(self, segment: shared_memory.SharedMemory, side: int, settings: PairSettings):
        self._shm = segment
        self.side = side
        self.settings = settings
        self._buf: memoryview = segment.buf  # type: ignore[assignment]
        self._control = np.ndarray((2, _LINE // 8), dtype=np.int64, buffer=self._buf)
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8)
        self._fence = threading.Lock()
        self.headers = 0  # headers this side posted
        self.posted = 0  # chunks this side wrote
        self.consumed = 0  # chunks this side read
        self._control[side, _PID] = os.getpid()
        self._control[side, _NAMESPACE] = liveness.pid_namespace()
        self._closed = False
        liveness.beat_for(self)

    def tick(self) -> None:
        """One heartbeat (from the liveness thread)."""
        if not self._closed:
            self._control[self.side, _HEARTBEAT] += 1

    def peer_heartbeat(self) -> int:
        """The peer's heartbeat count (0 until it opened the channel)."""
        return self._peer(_HEARTBEAT)

    @property
    def peer_opened(self) -> bool:
        """Whether the peer has opened the channel (its side carries its process id)."""
        return self._peer(_PID) != 0

    def peer_state(self) -> str | None:
        """What ``/proc`` says of the peer (``liveness.process_state``), None when it has
        not opened the channel or lives in another PID namespace."""
        pid = self._peer(_PID)
        if pid == 0 or self._peer(_NAMESPACE) != liveness.pid_namespace():
            return None
        return liveness.process_state(pid)

    def close(self) -> None:
        """Detach from the segment."""
        self._closed = True
        del self._control, self._bytes, self._buf
        self._shm.close()

    def _publish(self, index: int, value: int) -> None:
        # A locked instruction is a full fence on x86: the data (including streaming stores
        # of large copies) is visible before the counter.
        with self._fence:
            pass
        self._control[self.side, index] = value

    def _peer(self, index: int) -> int:
        return int(self._control[1 - self.side, index])

    def _cell(self, side: int, k: int) -> torch.Tensor:
        start = 2 * _LINE + (2 * side + k % 2) * _CELL
        return self._bytes[start : start + _CELL]

    def _slot(self, side: int, k: int) -> torch.Tensor:
        s = self.settings
        start = _DATA_START + (side * s.slots + k % s.slots) * s.slot_bytes
        return self._bytes[start : start + s.slot_bytes]

    def post_header(self, header: torch.Tensor) -> None:
        """Publish this side's next header (uint8, at most one cell)."""
        invariant(header.numel() <= _CELL, "p2p header larger than its cell")
        cell = self._cell(self.side, self.headers)
        cell.zero_()
        cell[: header.numel()].copy_(header)
        self.headers += 1
        self._publish(_HEADERS, self.headers)

    def peer_header(self) -> torch.Tensor | None:
        """The peer's header matching this side's last posted one, once it is there."""
        if self._peer(_HEADERS) < self.headers:
            return None
        return self._cell(1 - self.side, self.headers - 1).clone()

    def free_slots(self) -> int:
        """Slots this side may write now (the peer consumed what was in them)."""
        return self.settings.slots - (self.posted - self._peer(_CONSUMED))

    def ready_chunks(self) -> int:
        """Chunks the peer posted that this side has not read yet."""
        return self._peer(_POSTED) - self.consumed

    def next_write_slot(self) -> torch.Tensor:
        """The slot of this side's next chunk (write it, then :meth:`commit_write`)."""
        return self._slot(self.side, self.posted)

    def commit_write(self) -> None:
        """Publish the chunk written into :meth:`next_write_slot`."""
        self.posted += 1
        self._publish(_POSTED, self.posted)

    def next_read_slot(self) -> torch.Tensor:
        """The slot of the peer's next unread chunk (read it, then :meth:`commit_read`)."""
        return self._slot(1 - self.side, self.consumed)

    def commit_read(self) -> None:
        """Free the slot read from :meth:`next_read_slot` for the peer."""
        self.consumed += 1
        self._publish(_CONSUMED, self.consumed)

    def send_chunks(self, src: torch.Tensor, done: int) -> int:
        """Copy chunks of ``src`` (uint8) from byte ``done`` into free slots; returns the new
        ``done`` (unchanged when no slot was free)."""
        size = self.settings.slot_bytes
        while done < src.numel() and self.free_slots() > 0:
            n = min(size, src.numel() - done)
            self.next_write_slot()[:n].copy_(src[done : done + n])
            done += n
            self.commit_write()
        return done

    def recv_chunks(self, dst: torch.Tensor, done: int) -> int:
        """Copy posted chunks into ``dst`` (uint8) from byte ``done``; returns the new
        ``done``."""
        size = self.settings.slot_bytes
        while done < dst.numel() and self.ready_chunks() > 0:
            n = min(size, dst.numel() - done)
            dst[done : done + n].copy_(self.next_read_slot()[:n])
            done += n
            self.commit_read()
        return done

    def abandon(self, reason: str) -> None:
        """Tell the peer this side gives up on the channel (its streams are out of step
        from now on), with ``reason`` for its error message (in this side's header cells,
        which a channel used only for streams leaves free)."""
        text = reason.encode()[: 2 * _CELL - 1]
        cells = self._bytes[2 * _LINE + 2 * self.side * _CELL :][: 2 * _CELL]
        cells.zero_()
        cells[: len(text)].copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        self._publish(_ABANDONED, 1)

    def peer_abandoned(self) -> str | None:
        """The reason the peer gave up on the channel, None while it has not."""
        if self._peer(_ABANDONED) == 0:
            return None
        cells = self._bytes[2 * _LINE + 2 * (1 - self.side) * _CELL :][: 2 * _CELL]
        return bytes(cells.tolist()).rstrip(b"\0").decode(errors="replace")


@dataclass
class PairWork:
    """What one batch does with one peer through its channel.

    Args:
        peer: the peer's rank in the group.
        header: this rank's encoded header for the peer (None: data only).
        check: compares the peer's header with what this rank expects; raises on a mismatch.
        sends / recvs: uint8 views of the tensors, each list in issue order.
    """

    peer: int
    header: torch.Tensor | None = None
    check: Callable[[torch.Tensor], None] | None = None
    sends: list[torch.Tensor] = field(default_factory=list)
    recvs: list[torch.Tensor] = field(default_factory=list)


class _Progress:
    """One :class:`PairWork` under way: header, then its two streams."""

    def __init__(self, work: PairWork, now: float) -> None:
        self.work = work
        self.channel: PairChannel | None = None
        self.header_checked = work.header is None
        self.posted = False
        self.send_at = [0] * len(work.sends)
        self.recv_at = [0] * len(work.recvs)
        self.last_moved = now

    @property
    def stage(self) -> str:
        return "data" if self.header_checked else "header"

    def finished(self) -> bool:
        done = all(at == t.numel() for at, t in zip(self.send_at, self.work.sends, strict=True))
        return done and all(
            at == t.numel() for at, t in zip(self.recv_at, self.work.recvs, strict=True)
        )

    def advance(self, channel: PairChannel) -> bool:
        """Do what the peer allows now; True if anything moved."""
        work, moved = self.work, False
        if not self.posted and work.header is not None:
            channel.post_header(work.header)
            self.posted = moved = True
        if not self.header_checked:
            received = channel.peer_header()
            if received is None:
                return moved
            if work.check is not None:
                work.check(received)
            self.header_checked = moved = True
        # One stream per direction, in issue order: only its first unfinished op moves.
        for sends, at, fn in (
            (work.sends, self.send_at, channel.send_chunks),
            (work.recvs, self.recv_at, channel.recv_chunks),
        ):
            for i, tensor in enumerate(sends):
                if at[i] < tensor.numel():
                    new = fn(tensor, at[i])
                    moved |= new != at[i]
                    at[i] = new
                    break
        return moved


class ShmPairs:
    """The shared-memory channels of one communicator's rank, opened on first use.

    Args:
        rank / world_size: this rank's place in the group.
        token: a name prefix every rank of the group agreed on (unique per communicator).
        pids: every group rank's process id (read only for peers of this PID namespace).
        tags: every group rank's ``liveness.process_tag()`` (segment names carry the creator's).
        local: for every group rank, whether it shares this machine (and shared memory).
        settings: channel sizes and the threshold (the same on every rank).
        timeout: seconds a peer may stay still before it is reported.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        token: str,
        pids: Sequence[int],
        tags: Sequence[str],
        local: Sequence[bool],
        settings: PairSettings,
        timeout: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.pids = list(pids)
        self.tags = list(tags)
        remove_stale_segments()  # channels of earlier jobs whose creators were killed
        self.local = list(local)
        self.settings = settings
        self.timeout = timeout
        self._silence = liveness.heartbeat_timeout()
        self._heard: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat, when it moved)
        self._channels: dict[int, PairChannel] = {}

    def sibling(self, suffix: str, slots: int) -> ShmPairs:
        """Channels to the same peers under other names, with ``slots`` slots per
        direction: streams independent of this set's (the pipeline's mailbox keeps messages
        in flight across calls, which must not interleave with :meth:`run`'s)."""
        return ShmPairs(
            rank=self.rank,
            world_size=self.world_size,
            token=self.token + suffix,
            pids=self.pids,
            tags=self.tags,
            local=self.local,
            settings=PairSettings(self.settings.min_bytes, self.settings.slot_bytes, slots),
            timeout=self.timeout,
        )

    def is_local(self, peer: int) -> bool:
        """Whether ``peer`` can be reached through shared memory."""
        return self.local[peer]

    def carries(self, peer: int, tensor: torch.Tensor) -> bool:
        """Whether a message of ``tensor`` to or from ``peer`` goes through shared memory."""
        nbytes = tensor.numel() * tensor.element_size()
        return (
            self.local[peer] and tensor.device.type == "cpu" and nbytes >= self.settings.min_bytes
        )

    def opened_peers(self) -> list[int]:
        """The peers whose channel this rank has mapped."""
        return list(self._channels)

    @property
    def open_channels(self) -> int:
        """How many pair segments this rank has mapped."""
        return len(self._channels)

    def _name(self, peer: int) -> str:
        lo, hi = sorted((self.rank, peer))
        # The creator's (the lower rank's) process id leads, so that a segment left by a
        # creator killed before its peer opened it is swept by the next job on this host
        # (shm.remove_stale_segments).
        return stale_sweepable_name(self.tags[lo], f"p2p{self.token}-{lo}-{hi}")

    def channel(self, peer: int) -> PairChannel | None:
        """The channel with ``peer``: created at once by the lower rank; opened by the higher
        one when it exists (None until then)."""
        channel = self._channels.get(peer)
        if channel is not None:
            return channel
        name, size = self._name(peer), self.settings.segment_bytes()
        if self.rank < peer:
            segment = untracked_segment(name, True, size)
            try:
                # Reserve the pages now (tmpfs only truncates): a full /dev/shm fails here,
                # not with SIGBUS on first touch.
                os.posix_fallocate(segment._fd, 0, size)  # type: ignore[attr-defined]
            except OSError as exc:
                segment.close()
                _unlink(name)
                raise CollectiveError(
                    f"rank {self.rank}: cannot reserve {size} bytes of shared memory for the "
                    f"point-to-point channel with rank {peer} ({exc}); free space in /dev/shm, "
                    "or set ZEROTRAIN_SHM=0 to send over the network backend instead"
                ) from exc
            channel = PairChannel(segment, 0, self.settings)
            # The name goes when the peer opened it; this covers a peer that never does.
            weakref.finalize(channel, _unlink, name)
        else:
            try:
                segment = untracked_segment(name, False, 0)
            except (FileNotFoundError, ValueError):  # not created, or not yet sized
                return None
            if segment.size < size:
                # Seen mid-creation (tmpfs showed a segment smaller than its final size to
                # a 4-rank ring once): not ready yet, like a missing one. A segment that
                # never grows is reported as a stalled peer after the timeout.
                segment.close()
                return None
            channel = PairChannel(segment, 1, self.settings)
            _unlink(name)
        self._channels[peer] = channel
        return channel

    def run(self, works: Sequence[PairWork]) -> None:
        """Swap headers and move data with every peer of ``works`` until all is done.

        Raises:
            PeerStalledError: a peer exited, or did not move for ``timeout`` seconds.
            Whatever a ``check`` raises (a mismatched header), before that pair's data moves.
        """
        now = time.monotonic()
        pending = [_Progress(w, now) for w in works]
        next_check, spins = now + _PEER_CHECK_S, 0
        while True:
            moved = False
            for p in pending:
                channel = p.channel or self.channel(p.work.peer)
                if channel is None:
                    continue
                if p.channel is None:
                    p.channel, moved = channel, True
                if p.advance(channel):
                    p.last_moved, moved = time.monotonic(), True
            pending = [p for p in pending if not (p.header_checked and p.finished())]
            if not pending:
                return
            if moved:
                spins = 0
                continue
            spins += 1
            now = time.monotonic()
            if spins > 64:
                pause(now - max(p.last_moved for p in pending))
            if now >= next_check:
                next_check = now + _PEER_CHECK_S
                self._check_peers(pending, now)

    def _state(self, peer: int, channel: PairChannel | None) -> str | None:
        """``liveness.process_state`` of ``peer`` where it can be known (same namespace)."""
        if channel is not None:
            state = channel.peer_state()
            if state is not None:
                return state
        if liveness.tag_owner(self.tags[peer]) is None:
            return None  # another PID namespace: its process id means nothing here
        return liveness.process_state(self.pids[peer])

    def _check_peers(self, pending: Sequence[_Progress], now: float) -> None:
        for p in pending:
            self.check_peer(p.work.peer, p.channel, p.stage, now - p.last_moved, now)

    def check_peer(
        self, peer: int, channel: PairChannel | None, stage: str, waited: float, now: float
    ) -> None:
        """Raise :class:`PeerStalledError` when ``peer``, which this rank has waited for
        ``waited`` seconds, exited, fell silent or is late past the timeout."""
        state = self._state(peer, channel)
        if state is not None and _gone(state):
            raise PeerStalledError(peer, stage, True, waited)
        if channel is not None and channel.peer_opened:
            beat = channel.peer_heartbeat()
            heard = self._heard.get(peer)
            if heard is None or heard[0] != beat:
                self._heard[peer] = (beat, now)
            elif now - heard[1] >= self._silence:
                silent = (
                    f"no heartbeat for {now - heard[1]:.0f} s; the process is "
                    f"{state or 'in another PID namespace'}; "
                    f"ZEROTRAIN_HEARTBEAT_TIMEOUT={self._silence:g}"
                )
                raise PeerStalledError(peer, stage, False, waited, silent)
        if waited >= self.timeout:
            raise PeerStalledError(peer, stage, False, waited)
