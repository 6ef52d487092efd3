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


# DeepSpeed 0.19.8's DynamicLossScaler(init_scale=1, scale_window, delayed_shift=hysteresis,
# consecutive_hysteresis) fed each pattern ('x' overflow, '.' clean): the scale after each step.
DEEPSPEED_SEQUENCES = [
    ("...x...", 3, 1, False, [1, 1, 1, 0.5, 0.5, 0.5, 0.5]),
    ("..x..x...", 3, 1, False, [1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]),
    ("xx...x", 3, 2, False, [1, 0.5, 0.5, 0.5, 0.5, 0.25]),
    ("x.x", 10, 2, False, [1, 1, 0.5]),
    ("x.x", 10, 2, True, [1, 1, 1]),
    ("......", 2, 1, False, [1, 1, 2, 2, 4, 4]),
    (
        "..x.x....x......xx...",
        3,
        2,
        False,
        [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 1, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1],
    ),
    (
        "..x.x....x......xx...",
        3,
        2,
        True,
        [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 4, 4, 4, 4, 2, 2, 2, 2],
    ),
    (".x..x.......", 2, 3, False, [1, 1, 1, 1, 1, 1, 1, 2, 2, 4, 4, 8]),
]


@pytest.mark.parametrize(
    ("pattern", "window", "hysteresis", "consecutive", "deepspeed"), DEEPSPEED_SEQUENCES
)
def test_scale_moves_as_deepspeeds_dynamic_loss_scaler(
    pattern: str, window: int, hysteresis: int, consecutive: bool, deepspeed: list[float]
) -> None:
    """The first doubling at the (window + 1)-th clean step, then every window steps; an
    overflow halves once the hysteresis grace is spent, and restarts the count."""
    scaler = _scaler(window=window, hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    s = 2.0**16
    assert _run(scaler, pattern) == [s * f for f in deepspeed]


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
