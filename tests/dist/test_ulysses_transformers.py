"""Ulysses on a ``transformers`` model through the engine: its attention wrapped, nothing
rewritten.

A tiny Llama with grouped-query attention (4 query, 2 key/value heads, rotary positions)
trains 10 steps with its own loss (``labels``) and clipping, each rank of the sequence
group on its slice from ``engine.shard_sequence`` (positions, labels shifted before the
split, the group's token count). The 11-position sequences divide by none of the degrees.
At degree 2 the key/value heads are split, at 4 repeated to the degree, at 3 the query
heads split unevenly (2, 1, 1) with the key/value heads repeated to one per query head.
Losses and parameters must match single-process training within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import zerotrain
from tests.helpers.tensor import tiny_llama
from zerotrain.testing.dist import run_distributed

STEPS, BATCH, LENGTH, VOCAB = 10, 4, 11, 64
TOL = 1e-5
CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_clipping": 0.3,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 4000},
    "steps_per_print": 1000,
}


def _batches() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(3)
    )


def _reference() -> dict:
    model = tiny_llama(kv_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for ids in _batches():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _ulysses(degree: int) -> dict:
    model = tiny_llama(kv_heads=2)
    engine, _, _, _ = zerotrain.initialize(
        model=model, config={**CONFIG, "sequence_parallel_size": degree}
    )
    sequence = engine.groups.sequence
    losses = []
    for ids in _batches():
        loss = engine(**engine.shard_sequence({"input_ids": ids, "labels": ids})).loss
        engine.backward(loss)
        engine.step()
        losses.append(sequence.all_reduce_floats([loss.item()])[0] / sequence.world_size)
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_ulysses_llama_gqa_matches_one_process(degree):
    reference = _reference()
    for rank, got in enumerate(run_distributed(_ulysses, degree, degree, timeout=300)):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=TOL
        )
        for name, value in reference["params"].items():
            torch.testing.assert_close(
                got["params"][name], value, rtol=0, atol=TOL, msg=f"rank {rank}: {name}"
            )
