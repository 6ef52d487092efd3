"""DeepSpeed checkpoints loaded by ``engine.load_checkpoint`` and trained on.

The checkpoints under tests/data/deepspeed/ were written by DeepSpeed 0.19.8 on 2 ranks
(``tests/helpers/deepspeed_fixtures.py``: a tiny model with two param groups, AdamW, a
warm-up schedule, clipping active, large inputs one step after the save). For each,
zerotrain starts the same model from other weights, loads the checkpoint and trains the
steps DeepSpeed trained after saving it. Checked against DeepSpeed's own records:

* the weights equal DeepSpeed's fp32 view of the checkpoint (its ``zero_to_fp32``) exactly;
* the losses of the five continued steps equal DeepSpeed's (fp32: 1e-5; fp16 1e-3 and
  bf16 5e-3, their rounding), which needs the moments, step counts and schedule too;
* counters, the learning rate and the fp16 loss scale after the steps, and the client state
  as DeepSpeed returns it.

Saved at stages 0-3 in fp32 and bf16 (and fp16 at stages 1 and 3) on 2 ranks, loaded on 1,
2 and 4 ranks at the saved stage and at others, and the universal form of two of them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.deepspeed_fixtures import (
    AFTER,
    DATA,
    GLOBAL_BATCH,
    SAVED,
    UNIVERSAL,
    TinyNet,
    config,
    groups,
    train_steps,
)
from zerotrain.testing.dist import run_distributed

# (fixture, ZeRO stage of the loading job, its world size)
LOADS = [
    ("stage0_fp32", 0, 2),  # as saved
    ("stage1_bf16", 1, 2),
    ("stage2_fp32", 2, 2),
    ("stage2_bf16", 2, 2),
    ("stage3_fp32", 3, 2),
    ("stage3_bf16", 3, 2),
    ("stage1_fp16", 1, 2),
    ("stage3_fp16", 3, 2),
    (UNIVERSAL, 2, 2),
    ("universal_stage3_fp32", 1, 2),  # at another stage
    ("stage3_fp32", 1, 2),
    ("stage1_bf16", 3, 2),
    ("stage0_fp32", 2, 2),
    ("stage2_bf16", 3, 1),  # on one rank
    ("stage3_fp32", 0, 1),
    ("stage1_bf16", 1, 1),
    ("stage0_fp32", 1, 4),  # on four
    ("stage1_bf16", 1, 4),
    ("stage2_fp32", 3, 4),
    ("stage3_bf16", 2, 4),
    ("stage3_fp16", 2, 4),
]


def _expected(fixture: str) -> dict[str, Any]:
    return json.loads((DATA / fixture / "expected.json").read_text())


def _continue(fixture: str, stage: int) -> dict[str, Any]:
    world = dist.get_world_size()
    expected = _expected(fixture)
    cfg = config(stage, expected["precision"])
    cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world
    torch.manual_seed(123)  # other weights than DeepSpeed's: the load must replace them
    model = TinyNet()
    engine, _, _, scheduler = zerotrain.initialize(
        model=model, model_parameters=groups(model), config=cfg
    )
    _, client = engine.load_checkpoint(str(DATA / fixture))
    seen: dict[str, Any] = {
        "steps": engine.global_steps,
        "samples": engine.global_samples,
        "iteration": scheduler.last_batch_iteration,
        "client": {k: client.get(k) for k in ("epoch", "note")},
        "client_keys": sorted(client),
    }
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        seen["weights"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    seen["losses"] = train_steps(engine, range(SAVED, SAVED + AFTER), expected["precision"])
    seen["lr"] = engine.get_lr()
    seen["loss_scale"] = engine.loss_scaler.scale if engine.loss_scaler is not None else None
    engine.destroy()
    return seen


@pytest.mark.parametrize(("fixture", "stage", "world"), LOADS)
def test_deepspeed_checkpoint_continues_as_deepspeed_did(
    fixture: str, stage: int, world: int
) -> None:
    expected = _expected(fixture)
    seen = run_distributed(_continue, world, fixture, stage)[0]
    reference = torch.load(DATA / fixture / "fp32_reference.pt")
    for name, value in seen["weights"].items():
        torch.testing.assert_close(value, reference[name].to(value.dtype), rtol=0, atol=0)
    assert seen["steps"] == SAVED
    assert seen["samples"] == SAVED * GLOBAL_BATCH
    assert seen["iteration"] == SAVED - 1  # DeepSpeed's last_batch_iteration
    assert seen["client"] == {"epoch": 2, "note": "from DeepSpeed"}
    assert "global_steps" not in seen["client_keys"]
    assert "lr_scheduler" not in seen["client_keys"]
    # Within each format's rounding (measured: fp32 1.2e-7, fp16 2.2e-4, bf16 1.8e-3).
    tolerance = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 5e-3}[expected["precision"]]
    torch.testing.assert_close(
        torch.tensor(seen["losses"]),
        torch.tensor(expected["losses_after"]),
        rtol=tolerance,
        atol=0,
    )
    assert seen["lr"] == pytest.approx(expected["lr_after"], rel=1e-12)
    assert seen["loss_scale"] == expected.get("loss_scale_after")  # fp16: 512 -> 2048
