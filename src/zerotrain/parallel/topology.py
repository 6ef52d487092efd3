"""The parallel grid: global ranks <-> (pipe, data, sequence, tensor) coordinates.

Pure arithmetic, no process group, so every rule is tested in one process. Ranks are laid
out in row-major order over ``order`` (slowest-varying axis first). The default order
(pipe, data, sequence, tensor) makes the tensor axis vary fastest: tensor-parallel groups,
which communicate inside every layer, are consecutive ranks and so stay on one host, and
pipeline stages, which exchange only activations, are furthest apart. It is Megatron-LM's
layout: with 8 ranks, tensor 2, pipe 2, data 2, the tensor groups are [0, 1], [2, 3],
[4, 5], [6, 7], the pipeline groups [0, 4], [1, 5], [2, 6], [3, 7] and the data groups
[0, 2], [1, 3], [4, 6], [5, 7].

ZeRO shards over data x sequence: sequence-parallel ranks hold the same parameters and see
different parts of the same samples, so their gradients are summed like data-parallel ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PIPE, DATA, SEQUENCE, TENSOR = "pipe", "data", "sequence", "tensor"
AXES: tuple[str, ...] = (PIPE, DATA, SEQUENCE, TENSOR)
ZERO_AXES: tuple[str, ...] = (DATA, SEQUENCE)  # what ZeRO shards over


@dataclass(frozen=True, slots=True)
class Coordinates:
    """Where one rank sits in the grid."""

    pipe: int
    data: int
    sequence: int
    tensor: int

    def get(self, axis: str) -> int:
        """The coordinate along ``axis``."""
        return int(getattr(self, _check_axis(axis)))


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown parallel axis {axis!r}: the axes are {', '.join(AXES)}")
    return axis


def _axes(axes: str | Iterable[str]) -> tuple[str, ...]:
    chosen = (axes,) if isinstance(axes, str) else tuple(axes)
    for axis in chosen:
        _check_axis(axis)
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"axes {chosen} name an axis twice")
    return chosen


@dataclass(frozen=True)
class Topology:
    """A pipe x data x sequence x tensor grid of ranks.

    Args:
        pipe: pipeline stages.
        data: data-parallel replicas (ZeRO shards over data x sequence).
        tensor: tensor-parallel degree.
        sequence: sequence-parallel degree.
        order: the four axis names, slowest-varying first (default: pipe, data, sequence,
            tensor; tensor fastest keeps tensor groups on one host).

    Raises:
        ValueError: a size that is not a positive integer, or ``order`` that is not a
            permutation of the axes.
    """

    pipe: int = 1
    data: int = 1
    tensor: int = 1
    sequence: int = 1
    order: tuple[str, ...] = AXES
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Topology: {axis}={size!r}; each size must be an integer >= 1")
        order = tuple(self.order)
        if sorted(order) != sorted(AXES):
            raise ValueError(
                f"Topology: order={order!r} must name each of {', '.join(AXES)} exactly once "
                "(slowest-varying first)"
            )
        object.__setattr__(self, "order", order)
        strides, stride = {}, 1
        for axis in reversed(order):
            strides[axis] = stride
            stride *= getattr(self, axis)
        object.__setattr__(self, "_strides", strides)

    @classmethod
    def from_world(
        cls, world_size: int, *, pipe: int = 1, tensor: int = 1, sequence: int = 1
    ) -> Topology:
        """The grid whose data axis takes what the other axes leave of ``world_size``.

        Raises:
            ValueError: ``world_size`` is not a multiple of pipe x tensor x sequence.
        """
        model = pipe * tensor * sequence
        if world_size < 1 or model < 1 or world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by pipe {pipe} x tensor {tensor} x "
                f"sequence {sequence} = {model}: the data-parallel degree would be "
                f"{world_size / model:g}"
            )
        return cls(pipe=pipe, data=world_size // model, tensor=tensor, sequence=sequence)

    @property
    def world_size(self) -> int:
        """Number of ranks in the grid."""
        return math.prod(getattr(self, axis) for axis in AXES)

    def size(self, axes: str | Iterable[str]) -> int:
        """Number of ranks in one group along ``axes`` (an axis or several)."""
        return math.prod(getattr(self, axis) for axis in _axes(axes))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid {self} (0..{self.world_size - 1})")

    def coordinates(self, rank: int) -> Coordinates:
        """The coordinates of global ``rank``."""
        self._check_rank(rank)
        return Coordinates(**{a: (rank // self._strides[a]) % getattr(self, a) for a in AXES})

    def rank(self, pipe: int = 0, data: int = 0, sequence: int = 0, tensor: int = 0) -> int:
        """The global rank at these coordinates."""
        coords = {PIPE: pipe, DATA: data, SEQUENCE: sequence, TENSOR: tensor}
        for axis, value in coords.items():
            if not 0 <= value < getattr(self, axis):
                raise ValueError(
                    f"{axis}={value} is outside the grid {self} (0..{getattr(self, axis) - 1})"
                )
        return sum(value * self._strides[axis] for axis, value in coords.items())

    def group_ranks(self, axes: str | Iterable[str], rank: int) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except those along ``axes``
        (its group along them), in increasing order."""
        chosen = _axes(axes)
        base = self.coordinates(rank)
        fixed = sum(base.get(a) * self._strides[a] for a in AXES if a not in chosen)
        offsets = [
            sum(v * self._strides[a] for a, v in zip(chosen, values, strict=True))
            for values in itertools.product(*(range(getattr(self, a)) for a in chosen))
        ]
        return sorted(fixed + o for o in offsets)

    def all_groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Every group along ``axes``: a partition of the ranks, ordered by first rank."""
        chosen = _axes(axes)
        seen: set[int] = set()
        groups = []
        for rank in range(self.world_size):
            if rank not in seen:
                group = self.group_ranks(chosen, rank)
                seen.update(group)
                groups.append(group)
        return groups

    def is_first_stage(self, rank: int) -> bool:
        """Whether ``rank`` runs the first pipeline stage."""
        return self.coordinates(rank).pipe == 0

    def is_last_stage(self, rank: int) -> bool:
        """Whether ``rank`` runs the last pipeline stage."""
        return self.coordinates(rank).pipe == self.pipe - 1

    def stage_neighbour(self, rank: int, offset: int) -> int | None:
        """The rank ``offset`` stages away in ``rank``'s pipeline (same data, sequence and
        tensor coordinates), or None past either end."""
        c = self.coordinates(rank)
        stage = c.pipe + offset
        if not 0 <= stage < self.pipe:
            return None
        return self.rank(pipe=stage, data=c.data, sequence=c.sequence, tensor=c.tensor)

    def __str__(self) -> str:
        return " x ".join(f"{axis}={getattr(self, axis)}" for axis in self.order)
