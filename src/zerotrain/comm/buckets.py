"""Grouping many tensors into flat buffers so one collective carries many of them.

A bucket holds whole tensors, in order, up to ``bucket_numel`` elements; a tensor larger than
that gets a bucket of its own, and ``bucket_numel == 0`` means one tensor per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zerotrain.comm.collectives import Communicator


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[range]:
    """Split tensor indices ``0..len(numels)-1`` into consecutive buckets.

    Args:
        numels: element count of each tensor, in the order they will be packed.
        bucket_numel: target elements per bucket (0 = one tensor per bucket).

    Returns:
        One ``range`` of tensor indices per bucket, covering every index once, in order.
    """
    if bucket_numel < 0:
        raise ValueError(f"bucket_numel must be >= 0, got {bucket_numel}")
    buckets: list[range] = []
    start, filled = 0, 0
    for i, n in enumerate(numels):
        if i > start and (bucket_numel == 0 or filled + n > bucket_numel):
            buckets.append(range(start, i))
            start, filled = i, 0
        filled += n
    if start < len(numels):
        buckets.append(range(start, len(numels)))
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` (same dtype and device) into one new 1-D tensor."""
    if not tensors:
        raise ValueError("flatten needs at least one tensor")
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (inverse of ``flatten``)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat has {flat.numel()} elements but the tensors hold {offset}")


def broadcast_tensors(
    comm: Communicator, tensors: Sequence[torch.Tensor], bucket_numel: int, *, src: int = 0
) -> None:
    """Broadcast ``tensors`` from rank ``src`` in buckets (grouped by dtype), in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        for bucket in plan_buckets([t.numel() for t in group], bucket_numel):
            members = [group[i] for i in bucket]
            flat = flatten(members)
            comm.broadcast(flat, src=src, purpose="init")
            unflatten_into(flat, members)
