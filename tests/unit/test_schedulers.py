"""Learning-rate schedules: DeepSpeed's formulas and step semantics."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _opt(lr: float = 1.0, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.zeros(1)]} for _ in range(groups)], lr=lr)


def _trajectory(sched, steps: int) -> list[float]:
    lrs = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return lrs


def test_warmup_lr_log_curve_then_constant():
    sched = WarmupLR(_opt(), warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=10)
    lrs = _trajectory(sched, 12)
    # Before training and at iteration 0 the lr is the minimum (log(1) = 0).
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[1] == pytest.approx(0.1)
    assert lrs[5] == pytest.approx(0.1 + 0.9 * math.log(5) / math.log(10))
    assert lrs[11:] == [pytest.approx(1.0)] * 2


def test_warmup_lr_linear_and_no_warmup():
    lrs = _trajectory(WarmupLR(_opt(), 0.0, 1.0, 4, warmup_type="linear"), 5)
    assert lrs == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0])
    assert _trajectory(WarmupLR(_opt(), 0.0, 1.0, 0), 2) == pytest.approx([1.0] * 3)


def test_warmup_decay_lr_reaches_zero_at_total_steps():
    sched = WarmupDecayLR(
        _opt(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear"
    )
    lrs = _trajectory(sched, 25)
    assert lrs[11] == pytest.approx(1.0)  # iteration 10: end of warm-up
    assert lrs[16] == pytest.approx(0.5)  # iteration 15: halfway through the decay
    assert lrs[21:] == [0.0] * 5


def test_warmup_cosine_lr_ratios_multiply_the_optimizer_lr():
    sched = WarmupCosineLR(_opt(lr=2.0), total_num_steps=20, warmup_num_steps=0, cos_min_ratio=0.1)
    lrs = _trajectory(sched, 25)
    halfway = 0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2
    assert lrs[10] == pytest.approx(2.0 * halfway)  # iteration 9: done = 10 of 20
    assert lrs[-1] == pytest.approx(2.0 * 0.1)


def test_per_group_lrs_and_state_dict_round_trip():
    opt = _opt(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.5], warmup_max_lr=[1.0, 2.0], warmup_num_steps=5)
    for _ in range(3):
        sched.step()
    state = sched.state_dict()
    other = WarmupLR(_opt(groups=2), [0.0, 0.5], [1.0, 2.0], 5)
    other.load_state_dict(state)
    assert other.get_last_lr() == sched.get_last_lr()
    with pytest.raises(ValueError, match="2 groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


def test_warmup_max_lr_defaults_to_the_optimizer_lr():
    sched = WarmupLR(_opt(lr=0.5, groups=2), warmup_num_steps=0)
    assert sched.get_last_lr() == [0.5, 0.5]
