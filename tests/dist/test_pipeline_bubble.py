"""The executor's idle time is the schedule's, not more.

Each stage is one synthetic layer whose forward sleeps ``t`` and whose backward sleeps
``2t`` (sleeping uses no CPU, so four processes on two cores do not blur it). The measured
bubble of a step (the share of P x makespan during which a rank computes nothing) is within
10% of theory, ``(P-1)/(M+P-1)``, for GPipe and 1F1B on 2 and 4 stages with M = 8; the
simulator gives the same theory for the same instruction lists.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.parallel.pipeline.builders import build_schedule
from zerotrain.parallel.pipeline.schedule import ActionType
from zerotrain.parallel.pipeline.simulate import simulate
from zerotrain.pipe import LayerSpec, PipelineModule
from zerotrain.testing.dist import run_distributed

T = 0.12  # seconds of forward per stage and micro-batch (latencies of ~1 ms stay small)
MICRO = 8


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(T)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(2 * T)
        return grad


class SleepyLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _timeline(stages: int, schedule: str) -> list[tuple[str, float, float]]:
    module = PipelineModule(
        [LayerSpec(SleepyLayer) for _ in range(stages)], num_stages=stages, loss_fn=_loss
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": 1},
        "pipeline": {"schedule": schedule},
    }
    engine, _, _, _ = zerotrain.initialize(model=module, config=config)
    batches = [(torch.ones(1, 4), torch.zeros(1, 4)) for _ in range(MICRO)]
    engine.executor.record_timeline = True
    for _ in range(2):  # the first step pays for descriptions and warm-up
        engine.train_batch(iter(batches))
    return [(str(a), start, end) for a, start, end in engine.executor.timeline]


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_bubble_is_within_ten_percent_of_theory(stages, schedule):
    timelines = run_distributed(_timeline, stages, stages, schedule, timeout=180)
    spans = [(start, end) for rank in timelines for _, start, end in rank]
    makespan = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = sum(e - s for s, e in spans)
    measured = 1 - busy / (stages * makespan)
    theory = (stages - 1) / (MICRO + stages - 1)
    simulated = simulate(build_schedule(schedule, stages, MICRO)).bubble_fraction
    assert simulated == pytest.approx(theory)
    assert abs(measured - theory) <= 0.1 * theory, (measured, theory, makespan)
    # Every compute action ran, each about as long as its sleep.
    assert all(len(t) == 2 * MICRO for t in timelines)
    durations = [e - s for rank in timelines for a, s, e in rank if ActionType.FORWARD.value in a]
    assert min(durations) >= T
