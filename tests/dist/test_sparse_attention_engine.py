"""The ``sparse_attention`` config section is applied by ``initialize`` (swapped into the demo
GPT) and trains under ZeRO exactly as one process training the same swapped model on the
whole global batch; a model the section cannot be applied to is refused, never run dense."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    TINY,
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    reference_optimizer,
    train_zerotrain,
)
from zerotrain.sparse_attention.swap import sparse_attention_for_gpt
from zerotrain.testing.dist import run_distributed

# 64 tokens in blocks of 16: 4 blocks a row, of which the layout keeps 1 to 3.
SECTION = {
    "mode": "bslongformer",
    "block": 16,
    "num_sliding_window_blocks": 1,
    "global_block_indices": [0],
    "attention": "unidirectional",
}


def _spec(stage: int, sparse: bool = True) -> RunSpec:
    return RunSpec(
        optimizer="AdamW",
        opt_params=dict(PARITY_ADAM),
        steps=5,
        stage=stage,
        model=dataclasses.replace(TINY, block_size=64),
        extra_config={"sparse_attention": SECTION} if sparse else {},
    )


def _reference(spec: RunSpec, world_size: int, sparse: bool = True) -> dict:
    model = make_model(spec)
    if sparse:
        sparse_attention_for_gpt(model, SECTION)
    opt = reference_optimizer(spec, list(model.parameters()))
    batches = global_batches(spec, world_size)
    losses = []
    for step in range(spec.steps):
        loss = model(batches[step, :, :-1], batches[step, :, 1:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_sparse_gpt_under_zero_matches_one_process(stage):
    spec = _spec(stage)
    reference = _reference(spec, 2)
    for result in run_distributed(train_zerotrain, 2, spec):
        assert_matches(result, reference)
    # The layout matters: dense attention trains to other losses.
    dense = _reference(spec, 2, sparse=False)
    assert max(abs(a - b) for a, b in zip(dense["losses"], reference["losses"], strict=True)) > 1e-3


def _refused() -> str:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    try:
        zerotrain.initialize(
            model=model,
            config={"train_micro_batch_size_per_gpu": 1, "sparse_attention": {"mode": "fixed"}},
        )
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_model_without_attention_to_swap_is_refused():
    for message in run_distributed(_refused, 1):
        assert "sparse_attention is set but Sequential has no SparseSelfAttention" in message
