"""Keys of current DeepSpeed releases (0.16-0.19): accepted, and each either implemented,
refused by name, or logged as having no effect with the reason; never an unknown-key error."""

from __future__ import annotations

import pytest
import torch

from zerotrain.config.errors import ConfigError
from zerotrain.config.features import ignored_keys, not_implemented
from zerotrain.config.loader import load_config
from zerotrain.config.policies import resolve_precision

BASE = {"train_batch_size": 4}


def test_torch_autocast_bf16_is_implemented():
    cfg = load_config({**BASE, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert not_implemented(cfg) == []
    precision = resolve_precision(cfg)
    assert precision.autocast is torch.bfloat16
    assert precision.compute is None  # parameters stay fp32
    with precision.forward_context(torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    off = resolve_precision(load_config(BASE))
    with off.forward_context(torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


def test_torch_autocast_refusals():
    both = load_config({**BASE, "bf16": {"enabled": True}, "torch_autocast": {"enabled": True}})
    with pytest.raises(ConfigError, match="cannot be combined with the fp16 or bf16 sections"):
        resolve_precision(both)
    fp16 = load_config({**BASE, "torch_autocast": {"enabled": True, "dtype": "float16"}})
    assert any("torch_autocast.dtype=float16" in p for p in not_implemented(fp16))
    modules = {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}
    warned = ignored_keys(load_config({**BASE, "torch_autocast": modules}))
    assert len(warned) == 1
    assert "lower_precision_safe_modules" in warned[0]


def test_bf16_master_weights_are_refused_by_name():
    section = {"enabled": True, "bf16_master_weights_and_grads": True}
    cfg = load_config({**BASE, "bf16": section})
    assert any("bf16.bf16_master_weights_and_grads" in p for p in not_implemented(cfg))
    with pytest.raises(ConfigError, match="bf16_optimizer_states needs"):
        load_config({**BASE, "bf16": {"enabled": True, "bf16_optimizer_states": True}})
    off = load_config({**BASE, "bf16": {"enabled": True, "bf16_master_weights_and_grads": False}})
    assert not_implemented(off) == []


def test_zenflow_and_super_offload_are_accepted_with_a_warning():
    zero = {
        "stage": 3,
        "zenflow": {"topk_ratio": 0.1, "select_strategy": "auto", "overlap_step": True},
        "offload_optimizer": {"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.5},
    }
    cfg = load_config({**BASE, "zero_optimization": zero})
    assert not_implemented(cfg) == []
    warned = "\n".join(ignored_keys(cfg))
    assert "zero_optimization.zenflow has no effect" in warned
    assert "offload_optimizer.super_offload has no effect" in warned
    assert "offload_optimizer.cpuadam_cores_perc has no effect" in warned
    assert ignored_keys(load_config(BASE)) == []
    with pytest.raises(ConfigError, match="cpuadam_cores_perc"):
        load_config({**BASE, "zero_optimization": {"offload_optimizer": {"cpuadam_cores_perc": 2}}})
