"""save_16bit_model and _zero3_consolidated_16bit_state_dict as DeepSpeed documents them
(2 ranks, bf16, the demo GPT whose output head is tied to the token embedding): rank 0
writes the whole model in its training dtype, ties kept, loadable into a plain model; at
stage 3 only with stage3_gather_16bit_weights_on_model_save (else False, nothing written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, global_batches, make_model, micro_batch
from tests.helpers.training import zerotrain_config as base_config
from zerotrain.examples.gpt import GPT
from zerotrain.testing.dist import run_distributed


def _spec(stage: int) -> RunSpec:
    return RunSpec(steps=2, grad_accum=1, stage=stage, extra_config={"bf16": {"enabled": True}})


def _save(stage: int, path: str, gather: bool, filename: str, freeze: bool) -> dict[str, Any]:
    spec = _spec(stage)
    config = base_config(spec, 2)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    model = make_model(spec)
    if freeze:
        model.wpe.weight.requires_grad_(False)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    batches = global_batches(spec, 2)
    for step in range(spec.steps):
        x, y = micro_batch(batches, spec, step, 0, dist.get_rank(), 2)
        engine.backward(engine(x, y))
        engine.step()
    written = engine.save_16bit_model(path, filename, exclude_frozen_parameters=freeze)
    consolidated: Any = "not stage 3"
    try:
        state = engine._zero3_consolidated_16bit_state_dict()
        consolidated = None if state is None else sorted(state)
    except ValueError as error:
        consolidated = str(error)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return {"written": written, "whole": whole, "consolidated": consolidated}


@pytest.mark.parametrize("stage", [1, 3])
def test_save_16bit_model_writes_the_whole_tied_model_from_rank_0(stage, tmp_path):
    out = tmp_path / "model"
    rank0, rank1 = run_distributed(_save, 2, stage, str(out), True, "pytorch_model.bin", False)
    assert rank0["written"] is True
    assert rank1["written"] is True
    assert [p.name for p in out.iterdir()] == ["pytorch_model.bin"]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()  # still tied
    for name, value in rank0["whole"].items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value), name
    plain = GPT(_spec(stage).model).to(torch.bfloat16)
    plain.load_state_dict(state)
    assert plain.lm_head.weight is plain.wte.weight
    if stage == 3:
        assert rank0["consolidated"] == sorted(state)
        assert rank1["consolidated"] is None  # DeepSpeed: the state on rank 0 only
    else:
        assert "needs ZeRO stage 3" in rank0["consolidated"]


def test_stage_3_without_the_gather_flag_writes_nothing(tmp_path):
    out = tmp_path / "model"
    results = run_distributed(_save, 2, 3, str(out), False, "pytorch_model.bin", False)
    assert [r["written"] for r in results] == [False, False]
    assert not out.exists()


def test_safetensors_and_frozen_parameters_excluded(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model"
    run_distributed(_save, 2, 3, str(out), True, "model.safetensors", True)
    state = load_file(str(Path(out) / "model.safetensors"))
    assert "wpe.weight" not in state  # frozen, excluded
    assert "wte.weight" in state
    assert "lm_head.weight" not in state  # the tie, stored once
