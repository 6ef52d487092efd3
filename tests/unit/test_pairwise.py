"""The pairwise case generator the reduced parametrizations rely on."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.pairwise import pairwise


@pytest.mark.parametrize(
    "factors",
    [
        ([0, 1, 2, 3], [True, False], ["forward", "backward", "step", "save"]),
        ([0, 1, 2, 3], [2, 4], ["bf16", "fp32"]),
        ([2, 3], ["1f1b", "interleaved"], ["per_microbatch", "end_of_step"]),
        ([1, 2, 3], ["a", "b", "c"], [0, 1, 2], [True, False]),
    ],
)
def test_every_pair_of_values_meets_in_some_case(factors):
    cases = pairwise(*factors)
    assert len(set(cases)) == len(cases)
    for i, j in itertools.combinations(range(len(factors)), 2):
        met = {(case[i], case[j]) for case in cases}
        assert met == set(itertools.product(factors[i], factors[j])), (i, j)
    largest_pair = max(len(a) * len(b) for a, b in itertools.combinations(factors, 2))
    assert len(cases) <= largest_pair + 2  # near the lower bound, far below the product


def test_it_is_deterministic_and_refuses_a_single_factor():
    assert pairwise([1, 2], "ab", "xy") == pairwise([1, 2], "ab", "xy")
    with pytest.raises(ValueError):
        pairwise([1, 2])
