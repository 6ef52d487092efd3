"""Pipeline checkpoints name parameters by global layer index, so they move between grids.

Trained with 2 stages, saved, loaded into 4 stages (a different ZeRO stage too), trained,
saved, loaded into one stage with no pipeline at all (the plain forward/backward/step loop,
2 data-parallel ranks): with optimizer states, schedule and counters carried over, the
losses continue the uninterrupted run's trajectory within 1e-5, and the final parameters
match it. DeepSpeed's pipeline checkpoints keep optimizer states per rank, which bind them
to the grid they were saved on.
"""

from __future__ import annotations

from pathlib import Path

import torch

import zerotrain
from tests.helpers.pipeline import PipeRun, micro_batches, pipeline_module, stage_params
from zerotrain.examples.gpt import gpt_loss_fn
from zerotrain.testing.dist import run_distributed

MICRO = 4
LEGS = ((0, 2), (2, 4), (4, 6))  # steps of each leg


def _engine(stages: int, zero_stage: int, data_parallel: int):
    # The same global batch on every grid: fewer micro-batches per replica with more replicas.
    run = PipeRun(stages, "1f1b", zero_stage=zero_stage, micro_batches=MICRO // data_parallel)
    config = run.config(data_parallel)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(stages), config=config)
    return engine


def _leg(stages: int, zero_stage: int, first: int, last: int, load: str | None, save: str | None):
    import torch.distributed as dist

    data_parallel = dist.get_world_size() // stages
    engine = _engine(stages, zero_stage, data_parallel)
    if load is not None:
        engine.load_checkpoint(load, tag="ckpt")
        assert engine.global_steps == first
    losses = []
    for step in range(first, last):
        batches = micro_batches(engine, step, MICRO // data_parallel)
        if stages > 1:
            losses.append(float(engine.train_batch(iter(batches))))
            continue
        total = 0.0  # no pipeline: the plain loop over this rank's micro-batches
        for x, y in batches:
            total += engine.backward(gpt_loss_fn(engine(x), y)).item()
            engine.step()
        mean = total / len(batches)
        losses.append(engine.comm.all_reduce_floats([mean])[0] / engine.comm.world_size)
    if save is not None:
        engine.save_checkpoint(save, tag="ckpt")
    return {"losses": losses, "params": stage_params(engine)}


def test_two_stages_to_four_to_no_pipeline_continues_the_trajectory(tmp_path: Path):
    whole = run_distributed(_leg, 2, 2, 1, 0, 6, None, None, timeout=240)
    first = run_distributed(_leg, 2, 2, 1, *LEGS[0], None, str(tmp_path / "a"), timeout=240)
    second = run_distributed(
        _leg, 4, 4, 3, *LEGS[1], str(tmp_path / "a"), str(tmp_path / "b"), timeout=240
    )
    third = run_distributed(_leg, 2, 1, 2, *LEGS[2], str(tmp_path / "b"), None, timeout=240)
    resumed = first[0]["losses"] + second[0]["losses"] + third[0]["losses"]
    torch.testing.assert_close(
        torch.tensor(resumed), torch.tensor(whole[0]["losses"]), rtol=0, atol=1e-5
    )
    expected = {**whole[0]["params"], **whole[1]["params"]}
    for rank, result in enumerate(third):
        for name, value in result["params"].items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: {name} differs by {diff:.2e}"
    assert set(third[0]["params"]) == set(expected)
