"""Collectives through shared memory, for CPU ranks that share one machine.

gloo moves data between processes on one host through TCP loopback sockets; a shared
memory arena does the same work with plain memory copies, several times faster (the
ZeRO reduce-scatter + all-gather of a 13 MB model: ~5 ms here instead of ~20 ms). It is used
automatically when every rank of a gloo group runs on the same machine, on x86-64 (whose
memory ordering makes the flag protocol below safe); ``ZEROTRAIN_SHM=0`` turns it off.

The arena holds one cache line of control per rank, a short note per rank naming the
collective it is in, and ``world_size`` data slots. Ranks
synchronise on generation counters: ``barrier()`` raises this rank's counter and waits until
every counter reached it. On x86-64, data written before a counter store is visible to any
rank that sees the counter. A rank that exits, or stops answering (its heartbeat stands
still: ``liveness``), is noticed within seconds, and every wait is bounded by the
communicator's timeout: nothing hangs. Every collective first
publishes a signature (op, size, dtype and what it carries); ranks that meet in different
collectives raise at once, naming both, instead of exchanging the wrong data.

Operations run synchronously on the calling thread and process tensors in chunks that fit
the slots.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import contextlib
import datetime
import os
import platform
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from zerotrain.comm import liveness
from zerotrain.comm.splits import split_mismatches
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_LINE = 64  # bytes of control per rank: one cache line, so ranks never share a line
_HEARTBEAT, _NAMESPACE = 4, 5  # int64 positions in a control line
_NOTE = 192  # bytes per rank describing the collective it is in (for mismatch errors)
SLOT_BYTES = 8 << 20
_ALIGN = 64


class ShmPeerError(RuntimeError):
    """A peer never arrived at a shared-memory barrier (it exited, or is stuck)."""


class ShmMismatchError(RuntimeError):
    """Ranks entered different collectives (they took different code paths)."""


def supported() -> bool:
    """Whether shared-memory collectives can run on this machine."""
    return platform.machine() in ("x86_64", "AMD64") and os.environ.get("ZEROTRAIN_SHM") != "0"


def slot_bytes_from_env() -> int:
    """Bytes per slot: ``ZEROTRAIN_SHM_SLOT_BYTES`` or 8 MiB (larger slots, fewer barriers)."""
    raw = os.environ.get("ZEROTRAIN_SHM_SLOT_BYTES")
    if not raw:
        return SLOT_BYTES
    value = int(raw)
    if value < _ALIGN * 8:
        raise ValueError(f"ZEROTRAIN_SHM_SLOT_BYTES must be >= {_ALIGN * 8}, got {value}")
    return value


def host_identity() -> str:
    """Identifies this machine's kernel and the network namespace a process sees it through:
    ranks with the same identity can share memory. Processes in different network namespaces
    are treated as different hosts (containers, or the namespaces multi-host tests run in:
    their traffic must cross the link between them). A rank whose /dev/shm is another
    filesystem (another mount namespace) cannot open the arena, and the group falls back to
    the network backend then."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        network = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        network = "?"
    return f"{os.uname().nodename}/{boot}/{network}"


_SEGMENT_PREFIX = "zerotrain-"


def stale_sweepable_name(creator: str, rest: str) -> str:
    """A segment name that carries its creator's ``liveness.process_tag()``, so that a segment
    whose creator died before removing the name can be recognised and removed later."""
    return f"{_SEGMENT_PREFIX}{creator}-{rest}"


def segment_name() -> str:
    """A new arena's name (created by this process)."""
    return stale_sweepable_name(liveness.process_tag(), uuid.uuid4().hex[:16])


def _creator(name: str) -> str:
    """The creator's process tag in a segment's name."""
    return name[len(_SEGMENT_PREFIX) :].split("-", 1)[0]


def segments_of(pids: set[int], root: str = "/dev/shm") -> list[str]:
    """The names of the segments created by ``pids`` (processes of this PID namespace)."""
    return [name for name in _names(root) if liveness.tag_owner(_creator(name)) in pids]


def remove_segments_of(pids: set[int], root: str = "/dev/shm") -> list[str]:
    """Remove the segments created by ``pids`` (processes of this PID namespace that are
    known to have ended: a launcher's or a test harness's workers); returns their names."""
    removed = []
    for name in segments_of(pids, root):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(root, name))
            removed.append(name)
    return removed


def _names(root: str) -> list[str]:
    try:
        return [n for n in os.listdir(root) if n.startswith(_SEGMENT_PREFIX)]
    except OSError:
        return []


def remove_stale_segments(root: str = "/dev/shm") -> list[str]:
    """Remove segments (arenas, point-to-point channels) whose creating process is gone:
    killed between creating the segment and removing its name, which happens once every
    peer attached. Returns their names. Only names in ``/proc`` of this PID namespace are
    judged (segments of other PID namespaces are left alone), and only segments not touched
    for a minute (one being set up right now is left alone)."""
    removed: list[str] = []
    for name in _names(root):
        path = os.path.join(root, name)
        try:
            if not liveness.tag_owner_gone(_creator(name)):
                continue
            if time.time() - os.stat(path).st_mtime < 60:
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    if removed:
        log.info(
            "removed %d stale shared-memory segment(s) of dead zerotrain processes: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


class ShmArena(liveness.Tickable):
    """The shared segment: control lines and data slots. Each rank's control line holds
    its barrier generation, process id, the signatures of its last two collectives, its
    heartbeat (ticked by ``liveness``) and its PID namespace.

    Args:
        name: the segment's name (created by rank 0, opened by the others).
        rank / world_size: this rank's place.
        create: create the segment (rank 0) instead of opening it.
        timeout: how long any wait may last.
        global_ranks: the job's number of each rank of the group (for messages; default:
            the group's own numbers).
    """

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        create: bool,
        timeout: datetime.timedelta | None,
        slot_bytes: int = SLOT_BYTES,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.global_ranks = (
            list(global_ranks) if global_ranks is not None else list(range(world_size))
        )
        self.slot_bytes = slot_bytes
        self.timeout = (timeout or datetime.timedelta(seconds=600)).total_seconds()
        notes = 2 * _NOTE * world_size
        header = _LINE * world_size + notes
        size = header + world_size * slot_bytes
        self._shm = untracked_segment(name, create, size)
        if create:
            try:
                # Reserve the pages now: tmpfs only truncates, and a /dev/shm too small for
                # the arena would otherwise kill the process with SIGBUS on first touch.
                os.posix_fallocate(self._shm._fd, 0, size)  # type: ignore[attr-defined]
            except OSError:
                self._shm.close()
                _posixshmem.shm_unlink(self._shm._name)  # type: ignore[attr-defined]
                raise
        self._control = np.ndarray((world_size, _LINE // 8), dtype=np.int64, buffer=self._shm.buf)
        self._buf: memoryview = self._shm.buf  # type: ignore[assignment]
        self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8)
        self._notes_start = _LINE * world_size
        self._data_start = header
        self._generation = 0
        self._entered = 0
        self._fence = threading.Lock()
        self._control[rank, 1] = os.getpid()
        self._control[rank, 0] = 0
        self._namespace = liveness.pid_namespace()
        self._control[rank, _HEARTBEAT] = 0
        self._control[rank, _NAMESPACE] = self._namespace
        self._silence = liveness.heartbeat_timeout()
        self._heard: dict[int, tuple[int, float]] = {}  # peer -> (heartbeat, when it moved)
        self._closed = False
        liveness.beat_for(self)

    @property
    def name(self) -> str:
        """The segment's name."""
        return self._shm.name

    def unlink(self) -> None:
        """Remove the name (mappings stay valid; the memory goes when every rank detached)."""
        _posixshmem.shm_unlink(self._shm._name)  # type: ignore[attr-defined]

    def tick(self) -> None:
        """One heartbeat (from the liveness thread)."""
        if not self._closed:
            self._control[self.rank, _HEARTBEAT] += 1

    def close(self) -> None:
        """Detach from the segment."""
        self._closed = True
        del self._control, self._bytes, self._buf
        self._shm.close()

    def slot(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of slot ``index`` viewed as ``dtype``."""
        start = self._data_start + index * self.slot_bytes
        nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        invariant(nbytes <= self.slot_bytes, "shared-memory chunk larger than a slot")
        return self._bytes[start : start + nbytes].view(dtype)

    def tail(self, index: int, start: int, numel: int) -> torch.Tensor:
        """``numel`` int64 values at byte ``start`` of slot ``index`` (past the data)."""
        begin = self._data_start + index * self.slot_bytes + start
        invariant(start + numel * 8 <= self.slot_bytes, "shared-memory tail past its slot")
        return self._bytes[begin : begin + numel * 8].view(torch.int64)

    def enter(self, signature: str) -> None:
        """Start a collective: publish its signature, meet every rank, and raise
        :class:`ShmMismatchError` unless all of them entered the same collective.

        Signatures alternate between two places: a rank that races ahead into its next
        collective writes the other one, and cannot get further before every rank caught up.
        """
        self._entered += 1
        which = self._entered % 2
        encoded = signature.encode()
        start = self._note_start(self.rank, which)
        self._buf[start : start + _NOTE] = encoded[: _NOTE - 1].ljust(_NOTE, b"\0")
        self._control[self.rank, 2 + which] = zlib.crc32(encoded)  # all of it, not the note
        self.barrier(signature)
        codes = self._control[:, 2 + which]
        if int(codes.min()) != int(codes.max()):
            raise ShmMismatchError(self._mismatch_message(which))

    def _note_start(self, rank: int, which: int) -> int:
        return self._notes_start + (2 * rank + which) * _NOTE

    def _mismatch_message(self, which: int) -> str:
        notes = []
        for r in range(self.world_size):
            start = self._note_start(r, which)
            raw = bytes(self._buf[start : start + _NOTE]).rstrip(b"\0")
            notes.append(f"  rank {r}: {raw.decode(errors='replace')}")
        lines = "\n".join(notes)
        return (
            f"rank {self.rank}: the ranks entered different collectives (they took different "
            f"code paths, e.g. a module run on one rank and not another):\n{lines}"
        )

    def barrier(self, what: str) -> None:
        """Wait until every rank reached this barrier (generation ``n`` on every rank)."""
        self._generation += 1
        generation = self._generation
        # A locked instruction is a full fence on x86: every store of this rank's data
        # (streaming stores of large copies included) is visible before the counter is.
        with self._fence:
            pass
        self._control[self.rank, 0] = generation
        counters = self._control[:, 0]
        if int(counters.min()) >= generation:
            return
        deadline = time.monotonic() + self.timeout
        next_check = time.monotonic() + 0.5
        self._heard = {}
        spins = 0
        while int(counters.min()) < generation:
            spins += 1
            if spins > 64:
                time.sleep(0)  # yield the core to whatever else runs here
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(generation, what)
                next_check = now + 0.5
                if now >= deadline:
                    late = [p for p in range(self.world_size) if counters[p] < generation]
                    raise ShmPeerError(self._late_message(what, late, "did not arrive"))

    def _check_peers(self, generation: int, what: str) -> None:
        """Raise if a late peer is gone: exited or a zombie (seen through ``/proc`` when it
        shares this PID namespace), or silent, its heartbeat standing still for
        ``ZEROTRAIN_HEARTBEAT_TIMEOUT`` seconds (any namespace; also a stopped process).
        Only those peers are named: others may merely be late, waiting on them."""
        now = time.monotonic()
        exited: list[int] = []
        silent: dict[int, tuple[float, str]] = {}
        for peer in range(self.world_size):
            if self._control[peer, 0] >= generation:
                continue
            beat = int(self._control[peer, _HEARTBEAT])
            same_namespace = int(self._control[peer, _NAMESPACE]) == self._namespace
            state = (
                liveness.process_state(int(self._control[peer, 1]))
                if same_namespace
                else "in another PID namespace"
            )
            if state == "exited" or state.startswith("a zombie"):
                exited.append(peer)
                continue
            heard = self._heard.get(peer)
            if heard is None or heard[0] != beat:
                self._heard[peer] = (beat, now)
            elif now - heard[1] >= self._silence:
                silent[peer] = (now - heard[1], state)
        if exited:
            raise ShmPeerError(self._late_message(what, exited, "exited"))
        if silent:
            quiet = max(seconds for seconds, _ in silent.values())
            states = ", ".join(sorted({state for _, state in silent.values()}))
            verb = (
                f"stopped answering (no heartbeat for {quiet:.0f} s; the process is {states}; "
                f"ZEROTRAIN_HEARTBEAT_TIMEOUT={self._silence:g})"
            )
            raise ShmPeerError(self._late_message(what, list(silent), verb))

    def _late_message(self, what: str, peers: list[int], verb: str) -> str:
        """Names ``peers`` by their global ranks (the job's numbering, as in any log)."""
        named = [self.global_ranks[p] for p in peers]
        return (
            f"rank {self.global_ranks[self.rank]}: rank(s) {named} {verb} during a "
            f"shared-memory {what} (waited up to {self.timeout:.0f} s)"
        )


_TRACKER_LOCK = threading.Lock()


def untracked_segment(name: str, create: bool, size: int) -> shared_memory.SharedMemory:
    """Create or open a segment without Python's resource tracker (3.13's ``track=False``).

    The tracker would unlink the segment when any one rank exits, and ranks started by
    spawn share one tracker, which then reports every rank's bookkeeping as an error. The
    name is removed explicitly instead, as soon as every rank has attached.
    """
    with _TRACKER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda *args: None
        try:
            return shared_memory.SharedMemory(name=name, create=create, size=size)
        finally:
            resource_tracker.register = register


def _pieces(numel: int, per_piece: int) -> list[tuple[int, int]]:
    return [(lo, min(numel, lo + per_piece)) for lo in range(0, numel, per_piece)]


class ShmCollectives:
    """All-reduce, reduce-scatter, all-gather, broadcast and all-to-all over a
    :class:`ShmArena`."""

    def __init__(self, arena: ShmArena) -> None:
        self.arena = arena
        self.rank = arena.rank
        self.world_size = arena.world_size

    def _per_piece(self, dtype: torch.dtype) -> int:
        size = torch.tensor([], dtype=dtype).element_size()
        return max(1, (self.arena.slot_bytes // size) // _ALIGN * _ALIGN)

    def _slots(self, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        return [self.arena.slot(k, dtype, numel) for k in range(self.world_size)]

    def all_reduce(self, tensor: torch.Tensor, op: str, signature: str) -> None:
        """Reduce ``tensor`` in place across ranks (sum, max or min)."""
        self.arena.enter(signature)
        flat = tensor.view(-1)
        n = self.world_size
        for lo, hi in _pieces(flat.numel(), self._per_piece(flat.dtype)):
            slots = self._slots(flat.dtype, hi - lo)
            slots[self.rank].copy_(flat[lo:hi])
            self.arena.barrier("all-reduce")
            # Each rank reduces its own sub-range of the piece, in place in slot 0.
            sub = _pieces(hi - lo, -(-(hi - lo) // n))
            if self.rank < len(sub):
                a, b = sub[self.rank]
                _reduce_into(slots[0][a:b], [s[a:b] for s in slots], op)
            self.arena.barrier("all-reduce")
            flat[lo:hi].copy_(slots[0])
            self.arena.barrier("all-reduce")

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, signature: str) -> None:
        """Sum ``full`` across ranks into ``output`` (this rank's chunk); ``output`` may be
        this rank's chunk of ``full``."""
        self.arena.enter(signature)
        flat = full.view(-1)
        chunk = flat.numel() // self.world_size
        mine_lo, mine_hi = self.rank * chunk, (self.rank + 1) * chunk
        out = output.view(-1)
        for lo, hi in _pieces(flat.numel(), self._per_piece(flat.dtype)):
            slots = self._slots(flat.dtype, hi - lo)
            slots[self.rank].copy_(flat[lo:hi])
            self.arena.barrier("reduce-scatter")
            a, b = max(lo, mine_lo), min(hi, mine_hi)
            if a < b:
                parts = [s[a - lo : b - lo] for s in slots]
                _reduce_into(out[a - mine_lo : b - mine_lo], parts, "sum")
            self.arena.barrier("reduce-scatter")

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, signature: str) -> None:
        """Concatenate every rank's ``shard`` into ``output``; ``shard`` may be this rank's
        chunk of ``output``."""
        self.arena.enter(signature)
        flat = output.view(-1)
        chunk = shard.numel()
        mine_lo, mine_hi = self.rank * chunk, (self.rank + 1) * chunk
        src = shard.view(-1)
        for lo, hi in _pieces(flat.numel(), self._per_piece(flat.dtype)):
            region = self.arena.slot(0, flat.dtype, hi - lo)
            a, b = max(lo, mine_lo), min(hi, mine_hi)
            if a < b:
                region[a - lo : b - lo].copy_(src[a - mine_lo : b - mine_lo])
            self.arena.barrier("all-gather")
            flat[lo:hi].copy_(region)  # this rank's own part comes back unchanged
            self.arena.barrier("all-gather")

    def broadcast(self, tensor: torch.Tensor, src: int, signature: str) -> None:
        """Copy rank ``src``'s ``tensor`` to every rank."""
        self.arena.enter(signature)
        flat = tensor.view(-1)
        for lo, hi in _pieces(flat.numel(), self._per_piece(flat.dtype)):
            region = self.arena.slot(0, flat.dtype, hi - lo)
            if self.rank == src:
                region.copy_(flat[lo:hi])
            self.arena.barrier("broadcast")
            if self.rank != src:
                flat[lo:hi].copy_(region)
            self.arena.barrier("broadcast")

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        splits: tuple[Sequence[int], Sequence[int]],
        signature: str,
    ) -> None:
        """Send rank j the ``splits[0][j]`` rows of ``input`` for it and receive
        ``splits[1][i]`` rows from rank i into ``output``, in rank order (dim 0)."""
        n, rank = self.world_size, self.rank
        sends, recvs = list(splits[0]), list(splits[1])
        row = input.shape[1:].numel()
        # Each rank's splits go into the tail of its own slot before the signature barrier:
        # only this rank writes there, and every rank passed the previous collective's last
        # barrier, so nobody still reads it.
        tail = (self.arena.slot_bytes - _split_bytes(n)) // _ALIGN * _ALIGN
        self.arena.tail(rank, tail, 2 * n).copy_(torch.tensor(sends + recvs, dtype=torch.int64))
        self.arena.enter(signature)
        table = [self.arena.tail(r, tail, 2 * n).tolist() for r in range(n)]
        problems = split_mismatches([t[:n] for t in table], [t[n:] for t in table])
        if problems:
            raise ShmMismatchError("the split sizes disagree: " + "; ".join(problems))
        src, dst = input.view(-1), output.view(-1)
        send_at = _offsets(sends, row)
        recv_at = _offsets(recvs, row)
        dst[recv_at[rank] : recv_at[rank] + recvs[rank] * row].copy_(
            src[send_at[rank] : send_at[rank] + sends[rank] * row]
        )
        # Slot i holds one region per destination: rank i's next piece for each rank.
        elem = input.element_size()
        per_rank = tail // elem // n
        region = per_rank // _ALIGN * _ALIGN or max(1, per_rank)
        largest = max((t[j] for i, t in enumerate(table) for j in range(n) if i != j), default=0)
        for lo in range(0, largest * row, region):
            mine = self.arena.slot(rank, input.dtype, n * region)
            for j in range(n):
                a, b = lo, min(sends[j] * row, lo + region)
                if j != rank and a < b:
                    mine[j * region : j * region + b - a].copy_(
                        src[send_at[j] + a : send_at[j] + b]
                    )
            self.arena.barrier("all-to-all")
            for i in range(n):
                a, b = lo, min(recvs[i] * row, lo + region)
                if i != rank and a < b:
                    theirs = self.arena.slot(i, input.dtype, n * region)
                    dst[recv_at[i] + a : recv_at[i] + b].copy_(
                        theirs[rank * region : rank * region + b - a]
                    )
            self.arena.barrier("all-to-all")

    def barrier(self) -> None:
        """Wait for every rank."""
        self.arena.enter("barrier")


def _split_bytes(world_size: int) -> int:
    """Bytes at the end of each slot that hold a rank's all-to-all splits (aligned)."""
    return -(-2 * world_size * 8 // _ALIGN) * _ALIGN


def _offsets(counts: Sequence[int], row: int) -> list[int]:
    """Element offset of each rank's chunk: exclusive prefix sums of ``counts`` rows."""
    out, at = [], 0
    for count in counts:
        out.append(at)
        at += count * row
    return out


def _reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str) -> None:
    """``out = reduce(parts)``; ``out`` may alias ``parts[0]``. Sums of 16-bit floats are
    accumulated in fp32 and rounded once."""
    if op == "sum" and out.dtype in (torch.bfloat16, torch.float16) and len(parts) > 1:
        acc = parts[0].float()
        for part in parts[1:]:
            acc.add_(part)
        out.copy_(acc)
        return
    if op == "sum":
        if len(parts) == 1:
            out.copy_(parts[0])
            return
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
    elif op in ("max", "min"):
        fn = torch.maximum if op == "max" else torch.minimum
        if out.data_ptr() != parts[0].data_ptr():
            out.copy_(parts[0])
        for part in parts[1:]:
            fn(out, part, out=out)
    else:
        raise ValueError(f"unsupported reduction {op!r}")
