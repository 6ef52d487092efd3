"""Ulysses sequence parallelism through the engine trains exactly like one process.

The demo GPT (its attention cores named by ``GPT._sp_plan``) trains 20 steps with AdamW,
clipping active and a loss spike; every rank of a sequence group feeds its slice of the same
samples (``engine.shard_sequence``). Losses and every parameter must match single-process
training of the same global batch within 1e-5: at degree 2 and 4, with data parallelism and
ZeRO-3 around it, with tensor parallelism inside it, and at degree 3, where neither the 16
positions nor the 4 heads divide (slices of 6, 5, 5 positions, heads 2, 1, 1).
"""

from __future__ import annotations

import pytest
import torch

import zerotrain
from tests.helpers.pipeline import mismatches
from tests.helpers.tensor import TP_GPT, TensorRun, train_reference, train_tensor_parallel
from zerotrain.examples.gpt import GPT, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.parallel import Topology
from zerotrain.pipe import PipelineModule
from zerotrain.testing.dist import run_distributed

TOL = 1e-5

RUNS = {
    "sp2": TensorRun(tensor=1, sequence=2),
    "sp4": TensorRun(tensor=1, sequence=4),
    "sp3-uneven-heads-and-length": TensorRun(tensor=1, sequence=3),
    "sp2xdp2-stage3": TensorRun(tensor=1, sequence=2, data=2, zero_stage=3),
    "sp2xtp2-stage2": TensorRun(tensor=2, sequence=2, zero_stage=2),
}


@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
def test_ulysses_gpt_matches_one_process(run):
    reference = train_reference(run)
    results = run_distributed(train_tensor_parallel, run.world, run, timeout=300)
    for rank, result in enumerate(results):
        problems = mismatches(result, reference, TOL)
        assert not problems, f"rank {rank}: " + "; ".join(problems[:6])


class _Unplanned(torch.nn.Module):
    """Attention somewhere inside, but nothing says where."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


def _refusals() -> dict[str, str]:
    found = {}
    config = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}
    attempts = {
        "no plan": lambda: zerotrain.initialize(model=_Unplanned(), config=config),
        "pipeline": lambda: zerotrain.initialize(
            model=PipelineModule(gpt_pipeline_layers(TP_GPT), num_stages=1, loss_fn=gpt_loss_fn),
            config=config,
        ),
        "topology": lambda: zerotrain.initialize(
            model=GPT(TP_GPT),
            config={**config, "sequence_parallel_size": 2},
            topology=Topology(data=2),
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = "accepted"
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    engine, _, _, _ = zerotrain.initialize(model=GPT(TP_GPT), config=config)
    ids = torch.zeros(1, 8, dtype=torch.long)
    try:
        engine.shard_sequence({"input_ids": ids, "attention_mask": (ids == 0).long().tril()})
        found["padding"] = "accepted"
    except ValueError as err:
        found["padding"] = str(err)
    return found


def test_what_cannot_run_under_ulysses_is_refused_by_name():
    found = run_distributed(_refusals, 2, timeout=120)[0]
    assert "_sp_plan" in found["no plan"], found["no plan"]
    assert "_Unplanned" in found["no plan"], found["no plan"]
    assert "PipelineModule" in found["pipeline"], found["pipeline"]
    assert "sequence axis of 1" in found["topology"], found["topology"]
    assert "padding" in found["padding"], found["padding"]
