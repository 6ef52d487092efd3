"""The LR range test's suggestion (``optim.lr_finder``) on synthetic curves whose answer is
computed here independently: the minimum, the divergence cut, the steepest descent, the
smoothing, and the errors that say what was wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zerotrain.optim.lr_finder import (
    MAX_LR_DIVISOR,
    MIN_LR_DIVISOR,
    LossSmoother,
    LRRecord,
    plot_lr_range,
    suggest_lr_range,
)


def _bowl(num: int = 61) -> tuple[list[float], list[float]]:
    """lr = 10**x for x in -5..1 (step 0.1); loss = (x + 2)^2 + 1: lowest (1.0) at lr 1e-2,
    above 4x that once (x + 2)^2 > 3, i.e. from x = -0.2 on."""
    xs = [-5 + 0.1 * k for k in range(num)]
    return [10**x for x in xs], [(x + 2) ** 2 + 1 for x in xs]


def test_minimum_and_divergence_cut_on_a_known_curve():
    lrs, losses = _bowl()
    s = suggest_lr_range(lrs, losses, smoothing=0.0)
    first_diverged = next(k for k in range(1, len(losses)) if losses[k] > 4 * min(losses[:k]))
    assert first_diverged == 48  # x = -0.2, the first point above 4x the best (1.0)
    assert s.diverged
    assert s.lrs == tuple(lrs[:first_diverged])
    assert s.smoothed == pytest.approx(losses[:first_diverged], rel=1e-12)
    assert s.lr_at_min_loss == pytest.approx(1e-2, rel=1e-9)
    assert s.min_loss == pytest.approx(1.0, rel=1e-12)
    assert s.max_lr == pytest.approx(1e-2 / MAX_LR_DIVISOR, rel=1e-9)
    assert s.min_lr == pytest.approx(s.max_lr / MIN_LR_DIVISOR, rel=1e-12)
    assert lrs[0] <= s.min_lr < s.max_lr <= lrs[first_diverged - 1]
    assert s.notes == ()


def test_steepest_descent_is_where_the_loss_falls_fastest_per_log_lr():
    # A smooth step down centred on lr 1e-3 (x = -3), then a blow-up from lr 0.1 on.
    xs = np.arange(-6.0, 0.0, 0.1) + 0.05  # x = -3 is a segment's midpoint: no tie
    lrs = 10**xs
    losses = 3 - 2 / (1 + np.exp(-4 * (xs + 3))) + np.exp(6 * (xs + 1)) * (xs > -1)
    s = suggest_lr_range(lrs.tolist(), losses.tolist(), smoothing=0.0)
    # Independently: slopes of every segment up to the minimum, in natural log of the lr.
    best = int(np.argmin(losses[: len(s.lrs)]))
    slopes = np.diff(losses[: best + 1]) / np.diff(np.log(lrs[: best + 1]))
    expected = lrs[int(np.argmin(slopes))]
    assert s.steepest_lr == pytest.approx(expected, rel=1e-12)
    assert s.steepest_lr == pytest.approx(10**-3.05, rel=1e-9)  # the segment -3.05 -> -2.95


def test_smoothing_is_a_bias_corrected_moving_average():
    beta = 0.5
    lrs = [1e-4 * (k + 1) for k in range(8)]
    losses = [4.0, 2.0, 3.0, 1.0, 2.0, 0.5, 1.0, 0.8]
    expected, avg = [], 0.0
    for n, loss in enumerate(losses, start=1):
        avg = beta * avg + (1 - beta) * loss
        expected.append(avg / (1 - beta**n))
    assert expected[:2] == [4.0, pytest.approx((0.25 * 4 + 0.5 * 2) / 0.75)]
    s = suggest_lr_range(lrs, losses, smoothing=beta)
    assert s.smoothed == pytest.approx(expected, rel=1e-12)
    assert s.lr_at_min_loss == lrs[int(np.argmin(expected))]
    # A constant loss stays constant from the first step: no pull towards zero.
    smoother = LossSmoother(0.9)
    assert [smoother.add(2.5) for _ in range(5)] == pytest.approx([2.5] * 5, rel=1e-12)


def test_smoothing_rides_over_a_single_spike_that_raw_losses_would_call_divergence():
    lrs = [1e-4 * 1.2**k for k in range(30)]
    losses = [2.0 - 0.05 * k for k in range(30)]
    losses[10] = 7.0  # one bad batch: more than 4x the best raw loss so far (1.55)
    raw = suggest_lr_range(lrs, losses, smoothing=0.0)
    assert raw.diverged
    assert len(raw.lrs) == 10
    smoothed = suggest_lr_range(lrs, losses, smoothing=0.9)
    assert not smoothed.diverged
    assert len(smoothed.lrs) == 30


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_ends_the_curve(bad):
    lrs, losses = _bowl()
    losses[20] = bad
    s = suggest_lr_range(lrs, losses, smoothing=0.9)
    assert s.diverged
    assert len(s.lrs) == 20


def test_loss_still_falling_at_the_end_is_noted():
    lrs = [1e-3 * (k + 1) for k in range(20)]
    s = suggest_lr_range(lrs, [10.0 - 0.1 * k for k in range(20)], smoothing=0.0)
    assert not s.diverged
    assert s.lr_at_min_loss == lrs[-1]
    assert any("still falling" in note for note in s.notes)


def test_a_range_below_the_sweep_is_raised_to_its_first_lr_and_noted():
    # The minimum at the second point: one tenth of it lies below the first lr tried.
    lrs = [1e-4, 5e-4, 1e-3, 2e-3, 3e-3, 4e-3]
    losses = [2.0, 1.0, 1.5, 2.0, 2.5, 3.0]
    s = suggest_lr_range(lrs, losses, smoothing=0.0)
    assert s.lr_at_min_loss == 5e-4
    assert s.min_lr == s.max_lr == 1e-4
    assert any("raised to the smallest lr tried" in note for note in s.notes)
    assert any("maximum lr of about 0.001 " in note for note in s.notes)


@pytest.mark.parametrize(
    ("lrs", "losses", "message"),
    [
        ([1e-3, 2e-3, 3e-3, 4e-3], [4.0, 3.0, 2.0, 1.0], "at least 5 steps"),
        ([1e-3, 2e-3, 3e-3, 4e-3, 5e-3], [4.0, 3.0, 2.0, 1.0], "5 learning rates but 4 losses"),
        ([1e-3, 2e-3, 1e-3, 4e-3, 5e-3], [5.0, 4.0, 3.0, 2.0, 1.0], "must not decrease"),
        ([0.0, 2e-3, 3e-3, 4e-3, 5e-3], [5.0, 4.0, 3.0, 2.0, 1.0], "must be positive"),
        ([1e-3, 2e-3, 3e-3, 4e-3, 5e-3], [1.0, 1.5, 2.0, 2.5, 3.0], "never fell"),
        ([1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3], [2.0, 1.0, 9.0, 9.0, 9.0, 9.0], "diverged after 2"),
    ],
)
def test_errors_say_what_was_wrong(lrs, losses, message):
    with pytest.raises(ValueError, match=message):
        suggest_lr_range(lrs, losses, smoothing=0.0)


def test_smoother_rejects_bad_parameters():
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        LossSmoother(1.0)
    with pytest.raises(ValueError, match="divergence_factor must be > 1"):
        LossSmoother(0.9, 1.0)


def test_record_json_round_trip_writes_nan_as_null():
    record = LRRecord(3, 1e-3, math.nan)
    assert record.to_json() == {"step": 3, "lr": 1e-3, "loss": None}
    back = LRRecord.from_json(record.to_json())
    assert (back.step, back.lr, math.isnan(back.loss)) == (3, 1e-3, True)
    assert LRRecord.from_json(LRRecord(1, 0.5, 2.0).to_json()) == LRRecord(1, 0.5, 2.0)


def test_plot_writes_a_png(tmp_path):
    lrs, losses = _bowl()
    records = [
        LRRecord(k + 1, lr, loss) for k, (lr, loss) in enumerate(zip(lrs, losses, strict=True))
    ]
    path = tmp_path / "curve.png"
    plot_lr_range(records, suggest_lr_range(lrs, losses), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_lr_range(records, None, path)  # the curve alone, when there is no suggestion
    assert path.stat().st_size > 0
