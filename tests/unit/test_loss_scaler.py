"""The fp16 loss-scale rules (DeepSpeed's, so configs behave as their authors expect)."""

from __future__ import annotations

import pytest

from zerotrain.config.policies import LossScalePolicy
from zerotrain.precision.loss_scaler import LossScaleError, LossScaler


def _scaler(**kw) -> LossScaler:
    options = {
        "static_scale": None,
        "initial_scale": 2.0**16,
        "window": 3,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
    }
    return LossScaler(LossScalePolicy(**{**options, **kw}))


def _run(scaler: LossScaler, overflows: str) -> list[float]:
    """Feed a pattern of steps ('x' overflow, '.' clean); the scale after each."""
    seen = []
    for mark in overflows:
        scaler.update(mark == "x")
        seen.append(scaler.scale)
    return seen


def test_scale_doubles_after_a_window_of_clean_steps_and_halves_on_overflow():
    s = 2.0**16
    assert _run(_scaler(), "...x...") == [s, s, 2 * s, s, s, s, 2 * s]


def test_an_overflow_restarts_the_window():
    s = 2.0**16
    assert _run(_scaler(), "..x..x...") == [s, s, s / 2, s / 2, s / 2, s / 4, s / 4, s / 4, s / 2]


def test_hysteresis_forgives_overflows_until_the_scale_grows():
    s = 2.0**16
    # hysteresis 2: the first overflow is forgiven, the second halves; growing the scale
    # restores the grace.
    assert _run(_scaler(hysteresis=2), "xx...x") == [s, s / 2, s / 2, s / 2, s, s]
    # Clean steps alone do not restore it ...
    assert _run(_scaler(hysteresis=2, window=10), "x.x") == [s, s, s / 2]
    # ... unless consecutive_hysteresis says so.
    consecutive = _scaler(hysteresis=2, window=10, consecutive_hysteresis=True)
    assert _run(consecutive, "x.x") == [s, s, s]


def test_an_overflow_at_the_minimum_scale_stops_training():
    scaler = _scaler(initial_scale=4.0, min_scale=2.0)
    assert _run(scaler, "x") == [2.0]
    with pytest.raises(LossScaleError, match=r"fp16\.min_loss_scale \(2\)"):
        scaler.update(True)


def test_static_scale_never_moves():
    assert _run(_scaler(static_scale=128.0), "x...x") == [128.0] * 5


def test_state_round_trips_and_rejects_incomplete_state():
    scaler = _scaler(hysteresis=3)
    _run(scaler, "x..")
    copy = _scaler(hysteresis=3)
    copy.load_state_dict(scaler.state_dict())
    assert _run(copy, ".xx.") == _run(scaler, ".xx.")
    with pytest.raises(KeyError, match="clean_steps"):
        copy.load_state_dict({"scale": 1.0, "grace": 1})
