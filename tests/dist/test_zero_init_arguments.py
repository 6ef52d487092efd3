"""``zero.Init`` with DeepSpeed's arguments (``config_dict_or_path`` / ``config``,
``remote_device``, ``pin_memory``, ``dtype``, ``mpu``, ``module``, ``enabled``): what restates
the config is accepted and builds the same model at 2 ranks, what contradicts it is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.testing.dist import run_distributed


def _config(offload: str = "cpu", bf16: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": offload},
        },
    }


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _same_model_as_without_init(path: str) -> None:
    reference = {n: p.detach().clone() for n, p in _build().named_parameters()}
    config = _config()
    with zerotrain.zero.Init(
        config_dict_or_path=path, remote_device="cpu", pin_memory=True, dtype=torch.float32
    ):
        model = _build()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    with zerotrain.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), reference[name], rtol=0, atol=0)
    engine.destroy()


def test_init_with_deepspeed_arguments_builds_the_same_model(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_config()))
    run_distributed(_same_model_as_without_init, 2, str(path))


def test_config_alias_module_mpu_and_enabled_are_accepted() -> None:
    with zerotrain.zero.Init(config=_config(), mpu=object(), module=_build()):
        pass
    with zerotrain.zero.Init(config_dict_or_path=_config(bf16=True), dtype=torch.bfloat16):
        pass
    with zerotrain.zero.Init(enabled=False):
        model = _build()
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"config": _config(), "config_dict_or_path": _config()}, "not both"),
        ({"config_dict_or_path": _config(), "remote_device": "nvme"}, "contradicts"),
        ({"config_dict_or_path": _config("none"), "remote_device": "cpu"}, "contradicts"),
        ({"dtype": torch.bfloat16}, "compute dtype"),
        ({"data_parallel_group": object()}, "ZeRO group"),
        ({"zero_quantized_weights": True}, "quantised"),
        ({"param_swapper": object()}, "swapped"),
    ],
)
def test_arguments_that_cannot_apply_are_refused(arguments: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zerotrain.zero.Init(**arguments)
