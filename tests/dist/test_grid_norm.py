"""The global gradient norm over a grid whose axes hold different parameters.

With ``Topology(pipe=2, data=2)`` each pipeline stage holds its own layer, sharded by ZeRO
over its 2-rank data group. Clipping and the fp16 overflow decision need the norm of the
whole model's gradient: the strategy sums partial squares over its ZeRO group (when
sharded) and then over the pipe axis (``distinct_axes``), one composable reducer. Each
stage computes its own layer's gradient from its own inputs (no pipeline is needed to
check the reduction).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import GradReducePolicy, Stage3Policy
from zerotrain.parallel import ProcessGroups, Topology
from zerotrain.testing.dist import run_distributed
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.strategy import Stage3Options, ZeroStrategy
from zerotrain.zero.units import TrainableParam

GRID = Topology(pipe=2, data=2)
WIDTH = 24


def _stage_model(stage: int) -> nn.Module:
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def _inputs(pipe: int, data: int) -> torch.Tensor:
    return torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(10 * pipe + data))


def _reference_norm(scale: float) -> float:
    """Norm of every stage's data-averaged gradient, in one process."""
    total = 0.0
    for pipe in range(GRID.pipe):
        model = _stage_model(pipe)
        for data in range(GRID.data):
            (model(_inputs(pipe, data)).pow(2).sum() * scale / GRID.data).backward()
        total += sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    return total**0.5


def _grid_norm(zero_stage: int, scale: float) -> tuple[float, float]:
    groups = ProcessGroups.build(GRID, Communicator())
    coords = GRID.coordinates(dist.get_rank())
    model = _stage_model(coords.pipe)
    trainable = [
        TrainableParam(name, p, 0, i) for i, (name, p) in enumerate(model.named_parameters())
    ]
    stage3 = None
    if zero_stage == 3:
        stage3 = Stage3Options(model, Stage3Policy(10**6, 0, 10**8, ("Linear",)))
    strategy = ZeroStrategy(
        trainable,
        len(trainable),
        None,
        groups.zero,
        ZeroPolicy.for_stage(zero_stage),
        GradReducePolicy(None, False, 1.0, float(GRID.data)),
        stage3,
        distinct_axes=[groups.pipe],
    )
    strategy.begin_backward(True)
    (model(_inputs(coords.pipe, coords.data)).pow(2).sum() * scale).backward()
    strategy.end_backward()
    return float(strategy.grad_norm()), _reference_norm(scale)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_global_norm_sums_over_zero_shards_and_pipeline_stages(zero_stage):
    for got, expected in run_distributed(_grid_norm, 4, zero_stage, 1.0, timeout=120):
        assert got == pytest.approx(expected, rel=1e-6)


def test_an_overflow_on_one_stage_is_seen_by_every_stage():
    # A gradient that overflows on stage 1 only makes the norm non-finite everywhere, so
    # every rank skips the step.
    results = run_distributed(_overflow_on_stage_one, 4, timeout=120)
    assert all(not torch.isfinite(torch.tensor(norm)) for norm in results), results


def _overflow_on_stage_one() -> float:
    scale = float("inf") if GRID.coordinates(dist.get_rank()).pipe == 1 else 1.0
    return _grid_norm(1, scale)[0]
