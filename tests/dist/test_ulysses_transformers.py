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
from tests.helpers.tensor import tiny_llama, tiny_mistral
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


def _model(kind: str) -> torch.nn.Module:
    # Mistral's window (4) is shorter than the sequence (11): its mask is banded.
    return tiny_llama(kv_heads=2) if kind == "llama" else tiny_mistral(sliding_window=4)


def _reference(kind: str = "llama") -> dict:
    model = _model(kind)
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


def _ulysses(degree: int, kind: str = "llama") -> dict:
    model = _model(kind)
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


def test_a_sliding_window_is_kept_under_ulysses():
    """Review 2026-11-28, T2: the registered attention ran plain causal attention, so
    Mistral's window silently widened to the whole sequence. Now it is rebuilt for the
    gathered sequence: degree 2 equals one process, which builds the window itself."""
    reference = _reference("mistral")
    for got in run_distributed(_ulysses, 2, 2, "mistral", timeout=300):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=TOL
        )
        # The banded mask takes SDPA off its causal path, which sums in another order, and
        # Adam amplifies the rounding over 10 steps (measured: 1.5e-5 on 1 of 2048 values;
        # the lost window moved the losses by orders of magnitude more).
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=5 * TOL)
