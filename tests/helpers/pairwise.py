"""Pairwise (all-pairs) coverage: a few cases in which every value of each factor meets every
value of every other factor at least once.

Used where a test's full product of factors (stage x transport x phase, stage x world size
x dtype) costs more than it tells: the failures these tests exist for depend on one factor,
or on two together, not on three (docs/testing.md lists each use and its reason).
Deterministic: the same factors always give the same cases, in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


def pairwise(*factors: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Cases covering every pair of values of every two factors (greedy, as AETG does:
    each new case is the candidate of the full product that covers the most pairs still
    uncovered, the first such in product order). Two variants are built, one breaking
    ties towards the least used values (so each value gets its share of the cases); the
    shorter wins, the balanced one on equal length."""
    if len(factors) < 2 or any(len(f) == 0 for f in factors):
        raise ValueError("pairwise needs at least two factors, each with a value")
    balanced, plain = _greedy(factors, balance=True), _greedy(factors, balance=False)
    chosen = balanced if len(balanced) <= len(plain) else plain
    return [tuple(f[k] for f, k in zip(factors, case, strict=True)) for case in chosen]


def _greedy(factors: Sequence[Sequence[Any]], balance: bool) -> list[tuple[int, ...]]:
    pairs = list(itertools.combinations(range(len(factors)), 2))
    uncovered = {
        (i, a, j, b)
        for i, j in pairs
        for a in range(len(factors[i]))
        for b in range(len(factors[j]))
    }
    used = [[0] * len(f) for f in factors]  # how often each value was chosen so far
    cases: list[tuple[int, ...]] = []

    def score(case: tuple[int, ...]) -> tuple[int, int]:
        new = sum((i, case[i], j, case[j]) in uncovered for i, j in pairs)
        return new, -sum(used[i][v] for i, v in enumerate(case)) if balance else 0

    while uncovered:
        best = max(itertools.product(*(range(len(f)) for f in factors)), key=score)
        cases.append(best)
        for i, v in enumerate(best):
            used[i][v] += 1
        for i, j in pairs:
            uncovered.discard((i, best[i], j, best[j]))
    return cases
