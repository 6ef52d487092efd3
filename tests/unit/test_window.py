"""``BackwardWindow``: the plan each backward pass takes from the knobs set before it."""

from __future__ import annotations

import pytest

from zerotrain.utils.invariant import InvariantError
from zerotrain.zero.window import BackwardWindow, PassPlan


def test_by_default_the_engines_count_decides_and_every_pass_reduces():
    window = BackwardWindow(whole_gradients=True)
    assert window.plan(False) == PassPlan(last_micro_step=False, closes=False, reduces=True)
    assert window.plan(True) == PassPlan(last_micro_step=True, closes=True, reduces=True)


def test_a_pass_without_sync_reduces_nothing_and_does_not_close_the_window():
    window = BackwardWindow(whole_gradients=False)
    window.set_requires_gradient_sync(False)
    plan = window.plan(True)
    assert (plan.last_micro_step, plan.closes, plan.reduces) == (True, False, False)


def test_the_last_backward_override_wins_over_the_count_until_handed_back():
    window = BackwardWindow(whole_gradients=True)
    window.set_is_last_backward(True)
    assert window.plan(False).closes
    window.set_is_last_backward(False)
    assert not window.plan(True).closes
    window.set_is_last_backward(None)
    assert window.plan(True).closes


def test_averaging_is_asked_at_every_pass_and_a_window_without_it_is_local():
    answers = iter([True, False])
    window = BackwardWindow(whole_gradients=True)
    window.set_gradient_averaging(lambda: next(answers))
    assert window.plan(True) == PassPlan(last_micro_step=True, closes=True, reduces=True)
    assert window.plan(True) == PassPlan(
        last_micro_step=True, closes=True, reduces=False, local=True
    )


def test_local_gradients_are_refused_where_ranks_keep_only_slices():
    with pytest.raises(InvariantError, match="whole gradients"):
        BackwardWindow(whole_gradients=False).set_gradient_averaging(lambda: False)
