"""Which part of a global tensor a tensor-parallel rank holds.

A checkpoint stores each parameter in the coordinates of the whole (global) tensor, so that
a job with another tensor-parallel degree can read it. A :class:`TensorSplit` says where
this rank's local tensor sits in the global one: the dimension it is cut along and the
blocks of that dimension it holds, in the order the local tensor concatenates them. A plain
column or row split holds one block; a packed projection (a fused ``[q; k; v]`` weight, or
``[gate; up]``) holds its slice of every part, so that each rank's local tensor is again a
valid packed projection of fewer heads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSplit:
    """The blocks of the global tensor this rank holds.

    Attributes:
        full_shape: the global tensor's shape.
        dim: the dimension it is cut along.
        blocks: ``(offset, length)`` along ``dim`` of each block held, in the order the
            local tensor concatenates them (more than one only along dimension 0, where
            concatenation keeps each block's elements contiguous).
    """

    full_shape: tuple[int, ...]
    dim: int
    blocks: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape):
            raise ValueError(f"split dimension {self.dim} outside a tensor of {self.full_shape}")
        if len(self.blocks) > 1 and self.dim != 0:
            raise ValueError(
                "a tensor held as several blocks must be cut along dimension 0 (its local "
                f"flattening is then the blocks' flattenings in turn), got dim {self.dim}"
            )
        size = self.full_shape[self.dim]
        for offset, length in self.blocks:
            if offset < 0 or length <= 0 or offset + length > size:
                raise ValueError(f"block ({offset}, {length}) outside dimension of size {size}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank holds."""
        shape = list(self.full_shape)
        shape[self.dim] = sum(length for _, length in self.blocks)
        return tuple(shape)

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, lengths)`` in the global tensor of each block, in local order."""
        found = []
        for offset, length in self.blocks:
            offsets = [0] * len(self.full_shape)
            lengths = list(self.full_shape)
            offsets[self.dim], lengths[self.dim] = offset, length
            found.append((tuple(offsets), tuple(lengths)))
        return found


def even_split(
    full_shape: tuple[int, ...], dim: int, rank: int, ranks: int, parts: tuple[int, ...] = ()
) -> TensorSplit:
    """Rank ``rank`` of ``ranks``'s share of a tensor cut evenly along ``dim``; with
    ``parts`` (sizes along ``dim`` that add up to it: a packed projection), its share of
    each part.

    Raises:
        ValueError: a size that the ranks do not divide.
    """
    sizes = parts or (full_shape[dim],)
    if sum(sizes) != full_shape[dim]:
        raise ValueError(f"parts {sizes} do not add up to dimension {dim} of {full_shape}")
    blocks = []
    start = 0
    for size in sizes:
        if size % ranks:
            raise ValueError(f"size {size} does not split evenly over {ranks} ranks")
        share = size // ranks
        blocks.append((start + rank * share, share))
        start += size
    return TensorSplit(tuple(full_shape), dim, tuple(blocks))
