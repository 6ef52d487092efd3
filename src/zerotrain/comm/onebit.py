"""The 1-bit compressed all-reduce with error feedback (1-bit Adam, 0/1 Adam, 1-bit LAMB).

Every rank holds the same list of flat tensors (buckets). Each bucket is padded to a multiple
of ``N * lcm(N, 8)`` elements (N ranks) and cut into N equal chunks; rank j is the *server*
of chunk j of every bucket, and every rank is a *worker*. One call:

1. **Worker.** Add this rank's worker error to its values (error feedback), take one scale
   per *scale group* (the root mean square of the group's values: ``||x|| / sqrt(n)``) and
   the signs (0 counts as +1). What the signs and scales do not carry becomes the new
   worker error. The signs are packed 8 to a byte.
2. **Phase 1.** An all-to-all sends chunk j of the packed signs of every bucket to rank j;
   an all-gather spreads every worker's scales.
3. **Server.** Rank j decodes its chunk from every worker, averages them, adds its server
   error, and compresses the average again: signs, and one scale per scale group within
   the chunk. What that drops becomes the new server error.
4. **Phase 2.** An all-gather of every server's packed signs and scales; every rank decodes
   the whole average into the buckets.

So every rank ends with the same values: the average over ranks, as far as 1 bit per element
and error feedback carry it. On the wire per element: 1 bit in the all-to-all and 1 bit in
the all-gather, against the 2 x 32 bits an fp32 all-reduce moves in the ZeRO paper's model.

Scale groups are the caller's choice: DeepSpeed's 1-bit Adam compresses every parameter
on its own (one scale per parameter), its 1-bit LAMB the whole model as one buffer (one
scale). Here one call carries every bucket of the model (four collectives per step, not four
per parameter), and a scale group may be any set of ranges of it.

Packing: NumPy's ``packbits`` / ``unpackbits`` on CPU tensors (tens of times faster than the
same in torch ops), torch ops on accelerators.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zerotrain.comm.collectives import Communicator
from zerotrain.utils.invariant import invariant
from zerotrain.utils.norms import squared_norms, sum_squares

PURPOSE = "compressed"


def alignment(world_size: int) -> int:
    """What a bucket's length must be a multiple of: ``N * lcm(N, 8)`` (N equal chunks, each
    a whole number of bytes of signs)."""
    return world_size * math.lcm(world_size, 8)


def padded(numel: int, world_size: int) -> int:
    """``numel`` rounded up to :func:`alignment`."""
    align = alignment(world_size)
    return -(-numel // align) * align


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``[lo, hi)`` of bucket ``bucket``, in scale group ``group``."""

    bucket: int
    lo: int
    hi: int
    group: int


@dataclass(frozen=True)
class OneBitLayout:
    """The buckets of one compressed all-reduce and their scale groups.

    Args:
        world_size: ranks taking part.
        sizes: length of each bucket (multiples of :func:`alignment`).
        segments: ranges of the buckets with their scale group; together they must cover
            every element of every bucket exactly once.
    """

    world_size: int
    sizes: tuple[int, ...]
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        align = alignment(self.world_size)
        for b, size in enumerate(self.sizes):
            if size % align:
                raise ValueError(
                    f"bucket {b} has {size} elements, not a multiple of {align} "
                    f"(N * lcm(N, 8) for N = {self.world_size})"
                )
        covered = [0] * len(self.sizes)
        for s in sorted(self.segments, key=lambda s: (s.bucket, s.lo)):
            invariant(
                s.lo == covered[s.bucket] and s.hi > s.lo, f"segments overlap or leave gaps at {s}"
            )
            covered[s.bucket] = s.hi
        invariant(covered == list(self.sizes), "segments must cover every bucket")

    @cached_property
    def groups(self) -> int:
        """Number of scale groups."""
        return 1 + max((s.group for s in self.segments), default=-1)

    def chunk(self, bucket: int, server: int) -> tuple[int, int]:
        """``[lo, hi)`` of ``bucket`` that rank ``server`` averages."""
        size = self.sizes[bucket] // self.world_size
        return server * size, (server + 1) * size

    @cached_property
    def packed_row(self) -> int:
        """Bytes of one chunk of every bucket's packed signs."""
        return sum(size // self.world_size // 8 for size in self.sizes)

    def server_segments(self, server: int) -> list[Segment]:
        """The segments clipped to ``server``'s chunks: one server scale each."""
        found = []
        for s in self.segments:
            lo, hi = self.chunk(s.bucket, server)
            a, b = max(lo, s.lo), min(hi, s.hi)
            if a < b:
                found.append(Segment(s.bucket, a, b, s.group))
        return found

    @cached_property
    def max_server_segments(self) -> int:
        """The most server scales any rank sends (the phase-2 all-gather's row)."""
        return max(len(self.server_segments(j)) for j in range(self.world_size))


# -- packing --------------------------------------------------------------------------------------


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """The signs of 1-D ``values`` (length a multiple of 8; >= 0 is 1, < 0 is 0), 8 per
    uint8, first element in the highest bit."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.packbits(values.detach().numpy() >= 0))
    bits = (values >= 0).view(-1, 8).to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=values.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


# +-1.0 for the 8 bits of every byte value, first bit first: one lookup per packed byte.
_SIGNS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1


def unpack_signs(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """+-1.0 (float32) for each bit of ``packed`` (uint8), as :func:`pack_signs` packed them;
    written into ``out`` (contiguous, 8 elements per byte) when given."""
    if out is None:
        out = torch.empty(packed.numel() * 8, dtype=torch.float32, device=packed.device)
    if packed.device.type == "cpu":
        # A table lookup per byte: one pass, into the destination (NumPy's take).
        np.take(_SIGNS, packed.numpy(), axis=0, out=out.numpy().reshape(-1, 8))
        return out
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return out.copy_(bits.view(-1)).mul_(2).sub_(1)


def compress(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What 1 bit per element with one ``scale`` keeps of ``values``: ``scale * sign``, with
    sign(0) = +1 (for tests and references; the all-reduce decodes the packed signs)."""
    signs = torch.where(values >= 0, 1.0, -1.0).to(values.dtype)
    return signs.mul_(scale)


# -- the all-reduce -------------------------------------------------------------------------------


def _rms(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Root mean square over several ranges together (fp32 0-d)."""
    squares = sum_squares(squared_norms(parts))
    count = sum(p.numel() for p in parts)
    return (squares.sqrt() / math.sqrt(count)).float().to(parts[0].device)


class OneBitAllReduce:
    """Compressed all-reduces over ``comm`` for one :class:`OneBitLayout`.

    Args:
        comm: the ranks that average (their number is the layout's world size).
        layout: buckets and scale groups.
    """

    def __init__(self, comm: Communicator, layout: OneBitLayout) -> None:
        invariant(
            comm.world_size == layout.world_size,
            f"layout for {layout.world_size} ranks used by {comm.world_size}",
        )
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self._groups_of: list[list[Segment]] = [[] for _ in range(layout.groups)]
        self._segments_of: list[list[Segment]] = [[] for _ in layout.sizes]
        for s in layout.segments:
            self._groups_of[s.group].append(s)
            self._segments_of[s.bucket].append(s)
        # For every server and bucket: (server scale index, lo, hi relative to the chunk,
        # scale group) of each segment inside the chunk.
        self._parts: list[list[list[tuple[int, int, int, int]]]] = []
        for j in range(layout.world_size):
            by_bucket: list[list[tuple[int, int, int, int]]] = [[] for _ in layout.sizes]
            for k, seg in enumerate(layout.server_segments(j)):
                lo = layout.chunk(seg.bucket, j)[0]
                by_bucket[seg.bucket].append((k, seg.lo - lo, seg.hi - lo, seg.group))
            self._parts.append(by_bucket)
        self._buffers: torch.Tensor | None = None

    def server_error_numel(self, bucket: int) -> int:
        """Length of this rank's server error for ``bucket`` (one chunk)."""
        return self.layout.sizes[bucket] // self.layout.world_size

    def __call__(
        self,
        buckets: Sequence[torch.Tensor],
        worker_errors: Sequence[torch.Tensor],
        server_errors: Sequence[torch.Tensor],
        label: str,
    ) -> None:
        """Replace ``buckets`` (fp32, 1-D, the layout's sizes) on every rank by their
        compressed average over the ranks, updating this rank's error-feedback buffers:
        ``worker_errors`` (one per bucket, full length) and ``server_errors`` (one chunk
        per bucket)."""
        layout, comm, n = self.layout, self.comm, self.layout.world_size
        invariant(
            [b.numel() for b in buckets] == list(layout.sizes),
            "buckets differ from the compression layout",
        )
        # Worker: error feedback, one scale per group, signs; the rest is the new error.
        for bucket, error in zip(buckets, worker_errors, strict=True):
            bucket.add_(error)
        scales = torch.stack(
            [_rms([buckets[s.bucket][s.lo : s.hi] for s in segs]) for segs in self._groups_of]
        )
        values = scales.tolist()
        packed = [pack_signs(bucket) for bucket in buckets]
        for b, bucket in enumerate(buckets):
            # error = x - scale * sign, from the very signs sent (decoded into the error
            # buffer itself, then updated element by element in place)
            error = unpack_signs(packed[b], out=worker_errors[b])
            for s in self._segments_of[b]:
                part = error[s.lo : s.hi]
                torch.add(bucket[s.lo : s.hi], part, alpha=-values[s.group], out=part)
        # Chunks are whole bytes of the packed signs: row j holds every bucket's chunk j.
        send = torch.cat([p.view(n, -1) for p in packed], dim=1).contiguous()
        # Phase 1: chunk j of every worker's signs to server j; every worker's scales.
        received = torch.empty_like(send)
        comm.all_to_all(received, send, purpose=PURPOSE, label=f"{label} signs")
        all_scales = torch.empty(n, layout.groups, dtype=torch.float32, device=scales.device)
        comm.all_gather_into(all_scales, scales, purpose=PURPOSE, label=f"{label} scales")
        # Server: average my chunk over the workers, add my error, compress again.
        row, server_scales = self._serve(received, all_scales, server_errors)
        # Phase 2: every server's signs and scales to everyone, decoded into the buckets.
        signs = torch.empty(n, layout.packed_row, dtype=torch.uint8, device=row.device)
        comm.all_gather_into(signs, row, purpose=PURPOSE, label=f"{label} server signs")
        gathered = torch.empty(n, server_scales.numel(), dtype=torch.float32, device=row.device)
        comm.all_gather_into(
            gathered, server_scales, purpose=PURPOSE, label=f"{label} server scales"
        )
        by_server = gathered.tolist()
        for j in range(n):
            at = 0
            for b, bucket in enumerate(buckets):
                lo, hi = layout.chunk(b, j)
                chunk = bucket[lo:hi]
                unpack_signs(signs[j, at : at + (hi - lo) // 8], out=chunk)
                at += (hi - lo) // 8
                for k, a, z, _ in self._parts[j][b]:
                    chunk[a:z].mul_(by_server[j][k])

    def _serve(
        self,
        received: torch.Tensor,
        all_scales: torch.Tensor,
        server_errors: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's part: the workers' values of this rank's chunks averaged, plus the
        server error, compressed again. Returns the packed signs and the scales (padded to
        the layout's ``max_server_segments``); updates ``server_errors``."""
        n, parts = self.layout.world_size, self._parts[self.rank]
        weights = all_scales.tolist()  # [worker][group]
        scales = torch.zeros(self.layout.max_server_segments, dtype=torch.float32)
        packed, at = [], 0
        for b, error in enumerate(server_errors):
            nbytes = error.numel() // 8
            signs, total = self._scratch(error.numel(), error.device)
            total.zero_()
            for w in range(n):  # sum of the workers' scale * sign, then over N
                unpack_signs(received[w, at : at + nbytes], out=signs)
                for _, lo, hi, group in parts[b]:
                    total[lo:hi].add_(signs[lo:hi], alpha=weights[w][group])
            at += nbytes
            average = total.div_(n).add_(error)
            for k, lo, hi, _ in parts[b]:
                scales[k] = _rms([average[lo:hi]])
            mine = pack_signs(average)
            unpack_signs(mine, out=error)  # then error = average - scale * sign, in place
            for k, lo, hi, _ in parts[b]:
                part = error[lo:hi]
                torch.add(average[lo:hi], part, alpha=-float(scales[k]), out=part)
            packed.append(mine)
        return torch.cat(packed), scales.to(received.device)

    def _scratch(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two chunk-sized buffers for the server's decoding and sums, kept between calls
        (fresh pages would be faulted in at every step)."""
        if self._buffers is None or self._buffers.shape[1] < numel:
            largest = max(size // self.layout.world_size for size in self.layout.sizes)
            self._buffers = torch.empty(2, largest, dtype=torch.float32, device=device)
        return self._buffers[0, :numel], self._buffers[1, :numel]

    def buffers(self) -> list[torch.Tensor]:
        """What it keeps between calls (memory accounting)."""
        return [] if self._buffers is None else [self._buffers]


class OneBitExchange:
    """Everything the 1-bit optimizers communicate, over the data-parallel group
    (``optim.compressed.Exchange``).

    Args:
        comm: the data-parallel group.
        layout: the buckets (the ZeRO units, padded to :func:`alignment`) and scale groups.
        sharded: ZeRO stage 1: each rank owns chunk ``rank`` of every bucket (the same
            ranges the compressed all-reduce serves), and parameters are split across ranks.
    """

    def __init__(self, comm: Communicator, layout: OneBitLayout, sharded: bool) -> None:
        self.comm = comm
        self.layout = layout
        self.sharded = sharded
        self._reduce = OneBitAllReduce(comm, layout)

    @property
    def world_size(self) -> int:
        """Ranks averaging."""
        return self.comm.world_size

    def average(
        self,
        buckets: Sequence[torch.Tensor],
        worker_errors: Sequence[torch.Tensor],
        server_errors: Sequence[torch.Tensor],
        label: str,
    ) -> None:
        """The compressed average (see :class:`OneBitAllReduce`)."""
        self._reduce(buckets, worker_errors, server_errors, label)

    def server_error_numel(self, bucket: int) -> int:
        """Length of this rank's server error for ``bucket``."""
        return self._reduce.server_error_numel(bucket)

    def buffers(self) -> list[torch.Tensor]:
        """Scratch kept between steps (memory accounting)."""
        return self._reduce.buffers()

    def gather_owned(self, fulls: Sequence[torch.Tensor]) -> None:
        """Each rank's chunk of every bucket into every rank's copy (full precision: once,
        when the compressed phase starts or resumes at stage 1)."""
        for b, full in enumerate(fulls):
            lo, hi = self.layout.chunk(b, self.comm.rank)
            self.comm.all_gather_into(full, full[lo:hi], purpose="optimizer", label="momentum")

    def sum_over_shards(self, tensor: torch.Tensor) -> None:
        """Sum per-parameter partial values over the ranks (stage 1; whole parameters need
        nothing)."""
        if self.sharded:
            self.comm.all_reduce(tensor, purpose="control", label="per-parameter sums")

    def max_over_shards(self, tensor: torch.Tensor) -> None:
        """Maximum of per-parameter partial values over the ranks (stage 1)."""
        if self.sharded:
            self.comm.all_reduce(tensor, op="max", purpose="control", label="per-parameter max")
