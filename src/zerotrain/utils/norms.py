"""Squared L2 norms of long flat tensors, accurate to fp32 rounding whatever their length.

torch's CPU reduction of one long fp32 vector accumulates in a handful of fp32 lanes, so its
error grows with the length: about 2e-4 relative at 3.3M elements and 7e-3 at 1e8
(measured against fp64), which is what a ZeRO flat buffer of a whole model hands it. The
clip coefficient of every step was off by that much, and with clipping active the loss
trajectory drifted away from DDP's (whose per-parameter norms are short reductions).

We cut the flat tensor into rows of ``ROW`` elements, take every row's norm in fp32 (a short
reduction: relative error about 1e-8) and add the rows' squares in fp64. That is as fast as
the single fp32 reduction (both are memory-bound) and lands within one fp32 ulp of the fp64
value at every length we measured (1e5 to 1e8; benchmarks/grad_norm.py), where casting the
whole tensor to fp64 costs 6-10x the time and a temporary twice its size.

The global gradient norm (``shard_squared_norms``, over every unit's gradient shard each
step) reduces shards of at most ``SHORT`` elements in fp64 outright (relative error about
1e-14; their widened temporary is small), all of them in one ``torch._foreach_norm``
(one kernel on a GPU, instead of a dozen operations per shard); only long ones go by rows.
Optimizers' own norms (LAMB's trust ratios, the 1-bit optimizers' scales) keep
``squared_norm``'s rows, whose values their references reproduce bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROW = 1024
SHORT = 32 * ROW


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``tensor``'s elements as a 0-d fp64 tensor on its device.

    Args:
        tensor: any shape and floating dtype; 16-bit values are squared in fp32.

    Returns:
        0-d float64 tensor.
    """
    flat = tensor.reshape(-1)
    whole = (flat.numel() // ROW) * ROW
    compute = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1, dtype=compute)
    total = rows.double().square().sum()
    if whole < flat.numel():
        total = total + flat[whole:].double().square().sum()
    return total


def squared_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``squared_norm`` of each tensor (0-d fp64 each)."""
    return [squared_norm(t) for t in tensors]


def sum_squares(squares: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of 0-d fp64 squares in a fixed order (0-d fp64; zero for none), so the total is
    bitwise the same wherever the squares were taken."""
    if not squares:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([s.double() for s in squares]).sum()


def shard_squared_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Sums of squares of gradient shards for the global norm (0-d fp64 each): the short
    ones (at most ``SHORT`` elements, on one device) in fp64, in one foreach reduction; the
    long ones as ``squared_norm``. A shard's value does not depend on which others it is
    taken with (a slice in a swap file, taken alone as it is written, matches)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    short = [i for i, t in enumerate(tensors) if t.numel() <= SHORT]
    if len({tensors[i].device for i in short}) > 1:
        short = []  # one foreach call runs on one device
    if short:
        # One dimension, as squared_norm reduces it (the order of a 2-D reduction differs).
        flat = [t if t.dim() == 1 else t.reshape(-1) for t in (tensors[i] for i in short)]
        norms = torch._foreach_norm(flat, 2, dtype=torch.float64)
        squares = torch.stack(list(norms)).square().unbind()
        for i, square in zip(short, squares, strict=True):
            out[i] = square
    pairs = zip(out, tensors, strict=True)
    return [square if square is not None else squared_norm(t) for square, t in pairs]
