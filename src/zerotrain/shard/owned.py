"""Copying this rank's range of a unit's flat layout out of the parameters' full values."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerotrain.shard.layout import FlatLayout
from zerotrain.utils.invariant import invariant

# The full value of parameter ``i`` of a layout.
ValueSource = Callable[[int], torch.Tensor]


def copy_owned_range(
    layout: FlatLayout,
    owned: tuple[int, int],
    value_of: ValueSource,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``[lo, hi)`` of the flattened, concatenated parameters as a new ``dtype`` tensor
    (padding is zero). ``value_of`` is called only for parameters that overlap the range."""
    lo, hi = owned
    out = torch.zeros(hi - lo, dtype=dtype, device=device)
    with torch.no_grad():
        for i, spec in enumerate(layout.params):
            a, b = max(lo, spec.start), min(hi, spec.end)
            if a >= b:
                continue
            value = value_of(i)
            invariant(tuple(value.shape) == spec.shape, f"{spec.fqn}: shape changed")
            out[a - lo : b - lo].copy_(value.reshape(-1)[a - spec.start : b - spec.start])
    return out
