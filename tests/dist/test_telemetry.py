"""The engine's reporting on 2 ranks: TensorBoard and CSV series read back from the files a
run wrote, the FLOPs profile of one step, the wall-clock breakdown and the comms summary in
the log."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import TINY, RunSpec, global_batches, micro_batch
from zerotrain.examples.gpt import GPT
from zerotrain.monitor import csv_file_name, tags
from zerotrain.testing.dist import run_distributed

SPEC = RunSpec(micro_batch=2, grad_accum=2)
STEPS = 4


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(out: str, stage: int) -> dict:
    records = _Records()
    logging.getLogger("zerotrain").addHandler(records)
    torch.manual_seed(0)
    model = GPT(TINY)
    config = {
        "train_micro_batch_size_per_gpu": SPEC.micro_batch,
        "gradient_accumulation_steps": SPEC.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": f"{out}/flops.txt"},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(SPEC, world)
    step_losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(SPEC.grad_accum):
            x, y = micro_batch(batches, SPEC, step, micro, rank, world)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        step_losses.append(total / SPEC.grad_accum)
    samples = engine.global_samples
    engine.destroy()
    logging.getLogger("zerotrain").removeHandler(records)
    return {"losses": step_losses, "lines": records.lines, "samples": samples}


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv_series(folder: Path, tag: str) -> list[tuple[int, float]]:
    with open(folder / csv_file_name(tag)) as f:
        return [(int(row["step"]), float(row["value"])) for row in csv.DictReader(f)]


@pytest.mark.parametrize("stage", [0, 3])
def test_two_rank_run_writes_series_profile_and_breakdown(tmp_path: Path, stage: int):
    pytest.importorskip("tensorboard")
    results = run_distributed(_train, 2, str(tmp_path), stage)
    rank0 = results[0]
    steps = [(s + 1) * SPEC.micro_batch * SPEC.grad_accum * 2 for s in range(STEPS)]
    assert rank0["samples"] == steps[-1]

    scalars = _scalars(tmp_path / "tb")
    loss = scalars[tags.TRAIN_LOSS]
    assert [s for s, _ in loss] == steps
    # Rank 0's own loss of each step (mean over its micro-batches), as DeepSpeed logs it.
    assert [v for _, v in loss] == pytest.approx(rank0["losses"], rel=1e-6)
    for tag in (tags.LEARNING_RATE, tags.GRAD_NORM, tags.SAMPLES_PER_SEC):
        assert [s for s, _ in scalars[tag]] == steps, tag
        assert all(v > 0 for _, v in scalars[tag]), tag
    assert [v for _, v in scalars[tags.LEARNING_RATE]] == pytest.approx([1e-3] * STEPS)
    # Memory of every rank, at each periodic report (steps 2 and 4).
    for r in range(2):
        memory = scalars[tags.memory_tag(r)]
        assert [s for s, _ in memory] == [steps[1], steps[3]]
        assert all(100 < v < 10_000 for _, v in memory)  # MiB of a real process

    csv_dir = tmp_path / "csv"
    csv_loss = _csv_series(csv_dir, tags.TRAIN_LOSS)
    assert [s for s, _ in csv_loss] == steps
    assert [v for _, v in csv_loss] == pytest.approx(rank0["losses"], rel=1e-6)
    assert [s for s, _ in _csv_series(csv_dir, tags.memory_tag(1))] == [steps[1], steps[3]]

    flops = (tmp_path / "flops.txt").read_text()
    assert "flops profile of step 2" in flops
    assert "0 (Block)" in flops
    assert "attn (CausalSelfAttention)" in flops
    # Stage-3 parameters are counted at their full size (measured while gathered).
    assert "params           33.4 K" in flops
    lines = "\n".join(rank0["lines"])
    breakdown = [ln for ln in rank0["lines"] if ln.startswith("wall clock per step")]
    assert len(breakdown) == 2
    for phase in ("forward", "backward", "grad_comm_wait", "step"):
        assert f"{phase} " in breakdown[0]
    assert "collectives so far" in lines
    # memory_breakdown: the estimator's prediction next to the measured model states.
    predicted = [ln for ln in rank0["lines"] if ln.startswith("memory: predicted vs measured")]
    assert len(predicted) == 1
    totals = [ln for ln in predicted[0].splitlines() if ln.startswith("model states total")]
    assert totals[0].endswith("(+0.0%)"), predicted[0]
    assert "all_gather" in lines if stage == 3 else "all_reduce" in lines
