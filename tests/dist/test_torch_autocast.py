"""``torch_autocast`` (DeepSpeed 0.16+): the forward runs under ``torch.autocast(bfloat16)``
with fp32 parameters, gradients and optimizer; training equals plain PyTorch doing the same
on the global batch with DDP's arithmetic (clipping active)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.training import (
    PARITY_ADAM,
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    reference_optimizer,
    train_zerotrain,
)
from zerotrain.testing.dist import run_distributed

AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def _reference(spec: RunSpec, world: int) -> dict:
    """Plain PyTorch, DDP's arithmetic: each rank's half of the global batch forward and
    backward under autocast (bf16 results depend on the batch a matmul sees), gradients
    averaged in fp32, then clipping and AdamW on fp32 parameters."""
    model = make_model(spec)
    opt = reference_optimizer(spec, list(model.parameters()))
    batches = global_batches(spec, world)
    losses = []
    for step in range(spec.steps):
        opt.zero_grad()
        total = 0.0
        for part in batches[step].chunk(world):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(part[:, :-1], part[:, 1:])
            (loss / world).backward()
            total += loss.item() / world
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        losses.append(total)
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_autocast_matches_plain_autocast_training(stage):
    spec = RunSpec(
        optimizer="AdamW",
        opt_params=dict(PARITY_ADAM),
        steps=5,
        grad_accum=1,
        clip=0.5,
        stage=stage,
        extra_config=AUTOCAST,
    )
    reference = _reference(spec, 2)
    for result in run_distributed(train_zerotrain, 2, spec):
        assert all(p.dtype == torch.float32 for p in result["params"].values())
        assert_matches(result, reference)
