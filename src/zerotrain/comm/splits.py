"""Split arithmetic of an all-to-all (pure: no process group).

In ``all_to_all(output, input, output_split_sizes, input_split_sizes)`` rank i sends rows
``input[sum(in_i[:j]) : sum(in_i[:j + 1])]`` to rank j, and rank j receives rank i's rows
at ``output[sum(out_j[:i]) : ...]``. Each rank's splits differ legitimately; what must agree
is the matrix: ``in_i[j] == out_j[i]`` for every pair.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def resolve_splits(
    splits: Sequence[int] | None, rows: int, world_size: int, what: str
) -> list[int]:
    """Rows per rank along dim 0 of a tensor of ``rows`` rows (None: equal parts).

    Args:
        splits: rows to or from each rank, or None to split ``rows`` evenly.
        rows: the tensor's size along dim 0.
        world_size: ranks in the group.
        what: the argument's name, for errors (``"input_split_sizes"``).

    Returns:
        ``world_size`` non-negative ints summing to ``rows``.

    Raises:
        ValueError: wrong length, a negative or non-integer entry, a sum that is not
            ``rows``, or ``rows`` not divisible by ``world_size`` when ``splits`` is None.
    """
    if splits is None:
        if rows % world_size:
            raise ValueError(
                f"all_to_all: {what} not given, so dim 0 ({rows} rows) must divide evenly "
                f"among {world_size} ranks; pass {what} for uneven splits"
            )
        return [rows // world_size] * world_size
    values = list(splits)
    if len(values) != world_size:
        raise ValueError(
            f"all_to_all: {what} has {len(values)} entries, expected one per rank "
            f"({world_size}): {values}"
        )
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
        raise ValueError(f"all_to_all: {what} must be non-negative ints, got {values}")
    if sum(values) != rows:
        raise ValueError(
            f"all_to_all: {what} {values} sum to {sum(values)}, but the tensor has {rows} "
            "rows along dim 0"
        )
    return values


def split_mismatches(sends: Sequence[Sequence[int]], recvs: Sequence[Sequence[int]]) -> list[str]:
    """Every pair whose splits disagree: ``sends[i][j]`` rows rank i sends rank j,
    ``recvs[j][i]`` rows rank j expects from rank i. Empty when they all agree."""
    problems = []
    for i, row in enumerate(sends):
        for j, count in enumerate(row):
            if count != recvs[j][i]:
                problems.append(
                    f"rank {i} sends {count} rows to rank {j}, which expects {recvs[j][i]}"
                )
    return problems


def check_tensors(output: torch.Tensor, input: torch.Tensor) -> None:
    """Refuse tensors an all-to-all along dim 0 cannot carry.

    Raises:
        ValueError: 0-d, non-contiguous, different dtypes or devices, or different sizes
            past dim 0 (a row must be the same on both sides).
    """
    for name, t in (("output", output), ("input", input)):
        if t.dim() == 0:
            raise ValueError(f"all_to_all: {name} is 0-d; splits run along dim 0")
        if not t.is_contiguous():
            raise ValueError(f"all_to_all: {name} must be contiguous (call .contiguous())")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(
            f"all_to_all: output is {output.dtype} on {output.device}, input {input.dtype} on "
            f"{input.device}; they must match"
        )
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"all_to_all: rows differ: output {tuple(output.shape)}, input "
            f"{tuple(input.shape)} (sizes past dim 0 must be equal)"
        )
