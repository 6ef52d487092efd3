"""Cutting a layer list into contiguous pipeline chunks: pure functions, no process group.

Every rank computes the same boundaries from the same layer list, so no rank has to tell the
others where its layers start. Boundaries are DeepSpeed's ``parts``: ``parts[p]`` is the first
layer of part ``p`` and ``parts[-1]`` the number of layers.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zerotrain.parallel.pipeline.specs import LayerSpec
from zerotrain.utils.invariant import invariant

PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")


def _check_counts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts}: must be >= 1")
    if num_items < num_parts:
        raise ValueError(
            f"cannot cut {num_items} layer(s) into {num_parts} non-empty pipeline parts: give at "
            "least as many layers as stages x virtual_stages"
        )


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` parts whose sizes differ by at most one (the first
    ``num_items % num_parts`` parts get the extra item, as in DeepSpeed).

    Raises:
        ValueError: fewer items than parts, or ``num_parts < 1``.
    """
    _check_counts(num_items, num_parts)
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous non-empty parts whose largest total weight is
    the smallest possible (exact, not a heuristic).

    The optimal bottleneck is the total of some contiguous run of weights, so a binary search
    over those totals with a greedy feasibility test finds it. Among the partitions that reach
    it, each part in turn takes the weight (then the item count) closest to an even share of
    what is left, so the other parts are balanced too rather than front-loaded.

    Raises:
        ValueError: fewer items than parts, ``num_parts < 1``, or a negative or non-finite
            weight.
    """
    w = [float(x) for x in weights]
    _check_counts(len(w), num_parts)
    if any(not (x >= 0 and x != float("inf")) for x in w):
        raise ValueError(f"partition weights must be finite and >= 0, got {list(weights)}")
    prefix = [0.0, *itertools.accumulate(w)]
    bound = _min_bottleneck(prefix, num_parts)
    return _weightless_to_the_left(w, _balanced_cut(prefix, num_parts, bound))


def _weightless_to_the_left(weights: Sequence[float], parts: list[int]) -> list[int]:
    """Move each boundary past the weightless items that start its part, so they end the
    part before (as DeepSpeed's ``partition_balanced`` places them): a part then starts
    with a layer that has weight, not with the ReLU, pooling or dropout after the previous
    stage's last one. The parts' weights are unchanged; a part without weight is left as it
    is (its items are spread by count). Why:
    a stage whose first layer works in place on what it received (DeepSpeed's AlexNet,
    ``ReLU(inplace=True)``) is avoided, a pooling layer shrinks the message before it
    crosses, and a model moved from DeepSpeed keeps its stages' layers."""
    out = list(parts)
    for p in range(1, len(out) - 1):
        weighted = next((i for i in range(out[p], out[p + 1]) if weights[i] > 0), None)
        if weighted is not None:
            out[p] = weighted
    return out


def _run(prefix: list[float], i: int, j: int) -> float:
    return prefix[j] - prefix[i]


def _longest_run(prefix: list[float], start: int, bound: float) -> int:
    """The largest end ``j`` with ``_run(prefix, start, j) <= bound`` (runs grow with ``j``)."""
    n = len(prefix) - 1
    lo, hi = start, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _run(prefix, start, mid) <= bound:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _parts_needed(prefix: list[float], bound: float) -> int | None:
    """Fewest contiguous parts with every part's weight <= ``bound`` (None: impossible)."""
    n, start, parts = len(prefix) - 1, 0, 0
    while start < n:
        end = _longest_run(prefix, start, bound)
        if end == start:
            return None  # a single item heavier than the bound
        start, parts = end, parts + 1
    return parts


def _min_bottleneck(prefix: list[float], num_parts: int) -> float:
    n = len(prefix) - 1
    candidates = sorted({_run(prefix, i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the total (the last candidate) is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        needed = _parts_needed(prefix, candidates[mid])
        if needed is not None and needed <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _suffix_needs(prefix: list[float], bound: float) -> list[int]:
    """``needs[j]``: fewest parts under ``bound`` for the items from ``j`` on (0 at the end)."""
    n = len(prefix) - 1
    needs = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        needs[j] = 1 + needs[_longest_run(prefix, j, bound)]
    return needs


def _balanced_cut(prefix: list[float], num_parts: int, bound: float) -> list[int]:
    n = len(prefix) - 1
    needs = _suffix_needs(prefix, bound)
    parts = [0]
    for p in range(num_parts - 1):
        start, left = parts[-1], num_parts - p - 1  # parts still to place after this one
        last = min(_longest_run(prefix, start, bound), n - left)
        # needs[] only shrinks as j grows, so the ends that leave a feasible rest are a range.
        first = bisect.bisect_left(range(start + 1, last + 1), True, key=lambda j: needs[j] <= left)
        ends = range(start + 1 + first, last + 1)
        invariant(len(ends) > 0, f"no feasible end for part {p} under bottleneck {bound}")
        share = _run(prefix, start, n) / (left + 1)
        count = (n - start) / (left + 1)
        parts.append(
            min(ends, key=lambda j: (abs(_run(prefix, start, j) - share), abs(j - start - count)))
        )
    parts.append(n)
    return parts


def _class_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)  # a function: DeepSpeed matches its name


def trainable_numel(layer: Any) -> int:
    """Trainable parameter elements of one layer entry: a spec is built on the meta device
    (no memory, no other stage's layer made real), a module is counted as it is, and a plain
    callable has none. The random state is left as it was."""
    if isinstance(layer, LayerSpec):
        with torch.random.fork_rng(devices=[]):
            module = layer.build(device="meta")
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_weights(layers: Sequence[Any], method: str) -> list[float]:
    """One weight per layer for :func:`partition_balanced`, following DeepSpeed's methods.

    Args:
        layers: the pipeline's layer list (specs, modules and callables).
        method: ``"parameters"`` (trainable parameter count), ``"uniform"`` (1 each) or
            ``"type:REGEX"`` (1 for layers whose class name matches REGEX case-insensitively,
            else 0); case-insensitive.

    Raises:
        ValueError: an unknown method, an invalid regex, or a regex no layer matches.
    """
    kind = method.lower() if isinstance(method, str) else method
    if kind == "uniform":
        return [1.0] * len(layers)
    if kind == "parameters":
        return [float(trainable_numel(layer)) for layer in layers]
    if isinstance(kind, str) and kind.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(f"partition_method={method!r}: invalid regex ({err})") from None
        names = [_class_name(layer) for layer in layers]
        weights = [1.0 if n is not None and regex.search(n) else 0.0 for n in names]
        if not any(weights):
            found = sorted({n for n in names if n is not None})
            raise ValueError(
                f"partition_method={method!r}: no layer's class name matches {pattern!r} "
                f"(the layers are: {', '.join(found)})"
            )
        return weights
    raise ValueError(
        f"partition_method={method!r}: allowed methods are {', '.join(PARTITION_METHODS)}"
    )
