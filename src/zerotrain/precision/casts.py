"""Casting the model's inputs and the tensors the units do not hold to the compute dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor inside (tuples, lists, dicts) cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [cast_floating(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def cast_the_rest(
    model: nn.Module, managed: set[int], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.dtype]]:
    """Cast floating-point parameters outside the units and buffers to ``dtype``; returns
    each with the dtype it had."""
    cast = []
    with torch.no_grad():
        loose = [p for p in model.parameters() if id(p) not in managed]
        for tensor in [*loose, *model.buffers()]:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                cast.append((tensor, tensor.dtype))
                tensor.data = tensor.data.to(dtype)
    return cast
