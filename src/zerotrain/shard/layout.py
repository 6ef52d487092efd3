"""Pure offset arithmetic for flat buffers: where each parameter sits and what each rank owns.

No torch.distributed here, so every rule can be tested exhaustively in one process.

A unit's parameters are packed back to back into one flat buffer of ``numel`` elements,
padded to ``padded_numel`` (a multiple of ``world_size * align``). Rank r owns
``[r * shard_numel, (r + 1) * shard_numel)``; the part of a parameter that falls inside that
range is a :class:`Fragment`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter inside a flat buffer: name, shape and its span ``[start, end)``."""

    fqn: str
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the last element in the flat buffer."""
        return self.start + self.numel


@dataclass(frozen=True, slots=True)
class Fragment:
    """The part ``[lo, hi)`` of flattened parameter ``fqn`` that one rank owns, stored at
    ``local_offset`` in that rank's shard."""

    fqn: str
    lo: int
    hi: int
    local_offset: int

    @property
    def numel(self) -> int:
        """Number of elements in the fragment."""
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Packing of parameters into one buffer sharded over ``world_size`` ranks."""

    params: tuple[ParamSpec, ...]
    world_size: int = 1
    align: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.align < 1:
            raise ValueError(
                f"world_size and align must be >= 1, got {self.world_size}, {self.align}"
            )
        position = 0
        for spec in self.params:
            if spec.start != position:
                raise ValueError(f"{spec.fqn} starts at {spec.start}, expected {position}")
            position = spec.end

    @classmethod
    def pack(
        cls, shapes: Sequence[tuple[str, tuple[int, ...]]], world_size: int = 1, align: int = 1
    ) -> FlatLayout:
        """Lay out ``(fqn, shape)`` pairs back to back, in the given order."""
        specs: list[ParamSpec] = []
        start = 0
        for fqn, shape in shapes:
            spec = ParamSpec(fqn, tuple(shape), start)
            specs.append(spec)
            start = spec.end
        return cls(tuple(specs), world_size, align)

    @property
    def numel(self) -> int:
        """Elements of real parameters (without padding)."""
        return self.params[-1].end if self.params else 0

    @property
    def padded_numel(self) -> int:
        """Buffer length: ``numel`` rounded up to a multiple of ``world_size * align``."""
        chunk = self.world_size * self.align
        return -(-self.numel // chunk) * chunk

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (padding included)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer owned by ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def fragments(self, rank: int) -> list[Fragment]:
        """The pieces of parameters inside ``rank``'s shard, in buffer order."""
        lo, hi = self.shard_range(rank)
        found: list[Fragment] = []
        for spec in self.params:
            a, b = max(lo, spec.start), min(hi, spec.end)
            if a < b:
                found.append(Fragment(spec.fqn, a - spec.start, b - spec.start, a - lo))
        return found
