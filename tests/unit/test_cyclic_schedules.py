"""OneCycle and LRRangeTest against values computed independently here from the 1Cycle
definition (DeepSpeed's formulas), at every step, with the engine's step semantics: after k
optimizer steps the lr is the schedule's value for k completed steps."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config
from zerotrain.optim.cyclic_schedules import LRRangeTest, OneCycle


def _adam(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.5, 0.999))


def _triangle(t: int, first: int, second: int) -> float:
    # 0 at the start and end of the cycle, 1 after ``first`` steps; a straight line between.
    return t / first if t <= first else (first + second - t) / second


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = _adam()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=4,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=staircase,
    )
    for done in range(25):
        interval = done // 4 if staircase else done / 4
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 + 2.0 * interval), rel=1e-12)
        sched.step()
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer"):
        LRRangeTest(_adam(), lr_range_test_step_size=0)


def test_one_cycle_lr_and_momentum_then_decay():
    opt = _adam()
    first, second, decay = 10, 5, 4
    sched = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        decay_lr_rate=0.5,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        decay_step_size=decay,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    # Before any step: the minimum lr, and DeepSpeed's starting betas (min momentum, 0.99).
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    for done in range(1, 40):
        sched.step()
        group = opt.param_groups[0]
        if done <= first + second:
            scale = _triangle(done, first, second)
            lr, mom = 0.1 + 0.9 * scale, 0.9 - 0.1 * scale
        else:
            t = done - first - second
            lr, mom = 0.1 / (1 + 0.5 * t / decay), 0.9 * (1 + 0.1 * t / decay)
        assert group["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-15), done
        assert group["betas"][0] == pytest.approx(mom, rel=1e-12), done
        assert group["betas"][1] == 0.99


def test_one_cycle_stairs_hold_the_lr_flat():
    opt = _adam()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=10,
        cycle_second_step_size=6,
        cycle_first_stair_count=5,
        cycle_second_stair_count=3,
        cycle_momentum=False,
    )
    seen = []
    for done in range(1, 17):
        sched.step()
        up = math.floor(done * 5 / 10) / 5  # 5 stairs over the 10 rising steps
        down = math.floor((16 - done) * 3 / 6) / 3  # 3 over the 6 falling ones
        want = up if done <= 10 else down
        seen.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[0]["lr"] == pytest.approx(want, abs=1e-15), done
    assert max(seen) == 1.0  # the peak is reached exactly, not a stair below it
    assert opt.param_groups[0]["betas"] == (0.5, 0.999)  # momentum untouched


def test_one_cycle_without_decay_holds_the_end_values_and_sgd_keeps_its_momentum(caplog):
    opt = _adam()
    sched = OneCycle(opt, cycle_min_lr=0.2, cycle_max_lr=0.4, cycle_first_step_size=2)
    for _ in range(10):
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.2
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.7)
    with caplog.at_level(logging.WARNING):
        OneCycle(sgd, cycle_min_lr=0.1, cycle_max_lr=1.0)
    assert "cycle_momentum is off: SGD has no betas" in caplog.text
    assert sgd.param_groups[0]["momentum"] == 0.7
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive"):
        OneCycle(_adam(), 0.1, 1.0, cycle_first_step_size=0)


def test_state_dict_resumes_mid_cycle():
    opt = _adam()
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=6)
    for _ in range(4):
        sched.step()
    other = _adam()
    resumed = OneCycle(other, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=6)
    resumed.load_state_dict(sched.state_dict())
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert other.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


def test_config_sections_are_checked():
    cfg = load_config(
        {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}
    )
    assert cfg.scheduler is not None
    with pytest.raises(ConfigError, match="cycle_max_lr"):
        load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}})
    with pytest.raises(ConfigError, match="lr_range_test_step_size"):
        load_config(
            {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}}
        )
