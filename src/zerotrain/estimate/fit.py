"""The largest model (parameter count) whose training fits a memory budget per rank."""

from __future__ import annotations

from typing import Any

from zerotrain.estimate.core import estimate_memory

# Search ceiling: far above any model that trains today, low enough to stay exact in float.
_MAX_PARAMS = 10**15


def _fits(numel: int, memory_bytes: int, options: dict[str, Any]) -> bool:
    return estimate_memory(numel, **options).total <= memory_bytes


def largest_model_that_fits(memory_bytes: int, **options: Any) -> int:
    """The most parameters one rank can train within ``memory_bytes`` of device memory.

    Args:
        memory_bytes: device memory per rank.
        options: keyword arguments of :func:`estimate_memory` (``world_size``, ``stage``,
            ``dtype``, offload, batch...) for a model given by its parameter count.

    Returns:
        The parameter count (0 when even the fixed costs, such as activations, exceed
        ``memory_bytes``). Exact for the count-only model, whose device bytes grow with the
        count (a binary search over it).

    Raises:
        ValueError: ``memory_bytes`` is negative, or ``options`` are invalid.
    """
    if memory_bytes < 0:
        raise ValueError(f"memory must be >= 0 bytes, got {memory_bytes}")
    if "model" in options:
        raise ValueError("largest_model_that_fits searches the parameter count; drop 'model'")
    if not _fits(1, memory_bytes, options):
        estimate_memory(1, **options)  # invalid options raise here, not as "0 fits"
        return 0
    lo, hi = 1, 2
    while hi < _MAX_PARAMS and _fits(hi, memory_bytes, options):
        lo, hi = hi, hi * 2
    if hi >= _MAX_PARAMS and _fits(_MAX_PARAMS, memory_bytes, options):
        return _MAX_PARAMS
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if _fits(mid, memory_bytes, options):
            lo = mid
        else:
            hi = mid
    return lo
