"""ZeRO stage 0 (plain data parallelism): parity with single-process training for every
optimizer and every gradient-reduction option. Communication, memory and overlap are tested
for all stages together in test_zero.py; engine behaviour in test_engine.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.training import (
    PARITY_ADAM,
    RunSpec,
    assert_matches,
    make_model,
    train_reference,
    train_zerotrain,
)
from zerotrain.testing.dist import run_distributed

# Adam and AdamW: see PARITY_ADAM.
OPTIMIZERS = {
    "Adam": dict(PARITY_ADAM),
    "AdamW": dict(PARITY_ADAM),
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "Lamb": {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-6},
}


def _spec(optimizer: str, **overrides) -> RunSpec:
    base = {"two_groups": True, "freeze": "blocks.0.ln1.weight"}
    return RunSpec(optimizer=optimizer, opt_params=OPTIMIZERS[optimizer], **{**base, **overrides})


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_single_process_training(optimizer, world_size):
    """20 steps, accumulation 2, clipping 1.0, two param groups and a frozen parameter."""
    spec = _spec(optimizer)
    results = run_distributed(train_zerotrain, world_size, spec)
    reference = train_reference(spec, world_size)
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it actually trained
    for result in results:
        assert_matches(result, reference)
    frozen = spec.freeze
    assert torch.equal(results[0]["params"][frozen], make_model(spec).state_dict()[frozen])


@pytest.mark.slow
def test_matches_single_process_training_on_four_ranks():
    spec = _spec("Adam")
    results = run_distributed(train_zerotrain, 4, spec)
    assert_matches(results[0], train_reference(spec, 4))


@pytest.mark.parametrize(
    "extra",
    [
        {"prescale_gradients": True},
        {"gradient_predivide_factor": 2.0},
        {"zero_optimization": {"stage": 0, "overlap_comm": False, "reduce_bucket_size": 4000}},
        {"zero_optimization": {"stage": 0, "reduce_bucket_size": 0}},
    ],
    ids=["prescale", "predivide", "no-overlap", "bucket-per-tensor"],
)
def test_reduction_options_do_not_change_the_result(extra):
    spec = _spec("AdamW", extra_config=extra, steps=8)
    results = run_distributed(train_zerotrain, 2, spec)
    assert_matches(results[0], train_reference(spec, 2))
