"""Pipeline parallelism trains exactly like one process, through a loss spike.

The demo GPT as a PipelineModule (token embedding tied to the output head, 6 blocks, final
norm: 9 layers), 20 steps of AdamW with clipping active and one step of random targets
(``SPIKE_STEP``), fp32, matches single-process
training of the same global batch within 1e-5 in every loss and every parameter of every
stage (both copies of the tied embedding included), for GPipe, 1F1B and interleaved 1F1B
(2 virtual stages) on 2 stages x 2 data-parallel replicas and on 4 stages, at ZeRO stages
1, 2 and 3. The gradient policy (reduce every micro-batch or once per step) and stage 3's
``reshard_after_forward`` vary across the cases: they change when gradients move, never
the result; nor does activation checkpointing (``activation_checkpoint_interval``), which
two cases use.

The suite runs every case in ``ZEROTRAIN_P2P_MATCH=order`` (every message over gloo, matched
by order under one tag, as NCCL matches them); ``MAILBOX_CASES`` run again as users' gloo jobs
run by default, through the same-host shared-memory mailbox (``comm/shm_mailbox.py``).
"""

from __future__ import annotations

import pytest

from tests.helpers.pipeline import PipeRun, mismatches, train_pipeline, train_reference
from zerotrain.testing.dist import run_distributed

WORLD = 4
CASES = [
    # 2 stages x 2 replicas
    PipeRun(2, "gpipe", zero_stage=1),
    PipeRun(2, "gpipe", zero_stage=2, grad_reduce="per_microbatch"),
    PipeRun(2, "gpipe", zero_stage=3, reshard_after_forward=False),
    PipeRun(2, "1f1b", zero_stage=1, grad_reduce="per_microbatch"),
    PipeRun(2, "1f1b", zero_stage=2),
    PipeRun(2, "1f1b", zero_stage=3, grad_reduce="per_microbatch", checkpoint_interval=2),
    PipeRun(2, "interleaved", 2, zero_stage=1),
    PipeRun(2, "interleaved", 2, zero_stage=2, grad_reduce="per_microbatch"),
    PipeRun(2, "interleaved", 2, zero_stage=3),
    # 4 stages
    PipeRun(4, "gpipe", zero_stage=1, grad_reduce="per_microbatch"),
    PipeRun(4, "gpipe", zero_stage=2),
    PipeRun(4, "gpipe", zero_stage=3, grad_reduce="per_microbatch"),
    PipeRun(4, "1f1b", zero_stage=1),
    PipeRun(4, "1f1b", zero_stage=2, grad_reduce="per_microbatch"),
    PipeRun(4, "1f1b", zero_stage=3, reshard_after_forward=False),
    PipeRun(4, "interleaved", 2, zero_stage=1, grad_reduce="per_microbatch"),
    PipeRun(4, "interleaved", 2, zero_stage=2, checkpoint_interval=1),
    PipeRun(4, "interleaved", 2, zero_stage=3, grad_reduce="per_microbatch"),
]


# One per schedule, 4 stages (3 pairs of neighbours), the three ZeRO stages.
MAILBOX_CASES = [CASES[9], CASES[13], CASES[17]]


def _name(run: PipeRun) -> str:
    held = "" if run.reshard_after_forward else "-held"
    checkpointed = f"-ckpt{run.checkpoint_interval}" if run.checkpoint_interval else ""
    return (
        f"P{run.stages}-{run.schedule}-zero{run.zero_stage}-{run.grad_reduce}{held}{checkpointed}"
    )


@pytest.fixture(scope="module")
def references() -> dict[int, dict]:
    return {dp: train_reference(data_parallel=dp) for dp in (1, 2)}


@pytest.mark.parametrize("run", CASES, ids=_name)
def test_pipeline_matches_single_process_training(run, references):
    results = run_distributed(train_pipeline, WORLD, run, timeout=240)
    reference = references[WORLD // run.stages]
    for rank, result in enumerate(results):
        problems = mismatches(result, reference, 1e-5)
        assert not problems, f"rank {rank}: " + "; ".join(problems)
    # Every parameter of the model lives on some stage.
    held = set().union(*(r["params"] for r in results))
    assert held == set(reference["params"])


@pytest.mark.parametrize("run", MAILBOX_CASES, ids=_name)
def test_pipeline_through_the_mailbox_matches_single_process_training(run, references):
    results = run_distributed(
        train_pipeline, WORLD, run, timeout=240, env={"ZEROTRAIN_P2P_MATCH": "tag"}
    )
    reference = references[WORLD // run.stages]
    for rank, result in enumerate(results):
        problems = mismatches(result, reference, 1e-5)
        assert not problems, f"rank {rank}: " + "; ".join(problems)
