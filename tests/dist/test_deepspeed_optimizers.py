"""DeepSpeed's optimizer classes (``zerotrain.ops.adam.DeepSpeedCPUAdam`` / ``FusedAdam``,
``zerotrain.ops.lamb.FusedLamb``) passed to ``initialize`` train exactly as the config's
``optimizer`` section with the same values, at 2 ranks (offload included)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerotrain.ops.lamb import FusedLamb
from zerotrain.testing.dist import run_distributed

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _config(stage: int, offload: bool, section: dict | None) -> dict:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    if section is not None:
        config["optimizer"] = section
    return config


def _losses(config: dict, make_optimizer: Any = None) -> list[float]:
    model = _model()
    optimizer = make_optimizer(model) if make_optimizer is not None else None
    engine, *_ = zerotrain.initialize(model=model, config=config, optimizer=optimizer)
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(2, 8, generator=generator)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _decay_groups(model: nn.Module) -> list[dict]:
    # DeepSpeed-Chat's grouping: no weight decay on biases.
    return [
        {"params": [p for n, p in model.named_parameters() if "bias" not in n]},
        {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0},
    ]


CASES = {
    "cpu_adam_offload_stage2": (
        2,
        True,
        {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        lambda m: DeepSpeedCPUAdam(m.parameters(), lr=1e-2, weight_decay=0.1),
    ),
    "fused_adam_l2_stage1": (
        1,
        False,
        {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}},
        lambda m: FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=False),
    ),
    "fused_lamb_stage2": (
        2,
        False,
        {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        lambda m: FusedLamb(m.parameters(), lr=1e-2, weight_decay=0.01),
    ),
}


def _same_as_config(case: str) -> None:
    stage, offload, section, build = CASES[case]
    expected = _losses(_config(stage, offload, section))
    got = _losses(_config(stage, offload, None), build)
    assert got == expected, (got, expected)
    assert got[-1] != got[0]  # it trained


def _groups_same_as_config_groups() -> None:
    section = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    expected = _losses_with_groups(_config(3, True, section), None)
    got = _losses_with_groups(
        _config(3, True, None),
        lambda m: DeepSpeedCPUAdam(_decay_groups(m), lr=1e-2, weight_decay=0.1),
    )
    assert got == expected, (got, expected)


def _losses_with_groups(config: dict, make_optimizer: Any) -> list[float]:
    model = _model()
    if make_optimizer is None:
        engine, *_ = zerotrain.initialize(
            model=model, config=config, model_parameters=_decay_groups(model)
        )
    else:
        engine, *_ = zerotrain.initialize(
            model=model, config=config, optimizer=make_optimizer(model)
        )
    generator = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = engine(torch.randn(2, 8, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_optimizer_trains_like_config_section(case: str) -> None:
    run_distributed(_same_as_config, 2, case)


def test_param_groups_of_cpu_adam_are_kept_with_offload_at_stage3() -> None:
    run_distributed(_groups_same_as_config_groups, 2)


def test_by_hand_they_are_adam_and_lamb() -> None:
    # Without an engine they step whole parameters, as zerotrain's Adam and Lamb do.
    for cls in (DeepSpeedCPUAdam, FusedAdam):
        a, b = _model(), _model()
        ours = cls(a.parameters(), lr=1e-2, weight_decay=0.1)
        ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
        for model, opt in ((a, ours), (b, ref)):
            model(torch.ones(3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p, q)
            assert p.grad is None
    model = _model()
    lamb = FusedLamb(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(3, 8)).sum().backward()
    lamb.step()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda ps: DeepSpeedCPUAdam(ps, amsgrad=True), "no AMSGrad"),
        (lambda ps: DeepSpeedCPUAdam(ps, fp32_optimizer_states=False), "in fp32"),
        (lambda ps: FusedAdam(ps, amsgrad=True), "no AMSGrad"),
        (lambda ps: FusedLamb(ps, amsgrad=True), "no AMSGrad"),
        (lambda ps: FusedLamb(ps, max_grad_norm=1.0), "gradient_clipping"),
    ],
)
def test_arguments_without_meaning_here_are_refused(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(_model().parameters())


def test_fused_adam_set_grad_none_false_zeroes() -> None:
    model = _model()
    opt = FusedAdam(model.parameters(), set_grad_none=False)
    model(torch.ones(1, 8)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
