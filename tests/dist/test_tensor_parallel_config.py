"""Tensor parallelism from the config: DeepSpeed's AutoTP keys and the bad inputs.

The shared peer config that trains AutoTP at ``autotp_size: 4`` with ZeRO-2 (DeepSpeed's
Hugging Face example) trains a tiny ``transformers`` Llama on 4 ranks once its ``"auto"``
values are filled in the way the Hugging Face Trainer fills them, and its losses equal the
same config's without tensor parallelism on one rank. Bad inputs are refused, naming what
is wrong and what is allowed: a head count the degree does not divide, a model with no plan,
an unknown preset, LAMB (per-parameter trust ratios), a topology that contradicts the config.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import zerotrain
from tests.dist.test_peer_configs import PEER_DIR
from tests.helpers.tensor import TP_GPT, build_gpt, tiny_llama
from zerotrain.parallel.topology import Topology
from zerotrain.testing.dist import run_distributed

transformers = pytest.importorskip("transformers")

AUTOTP_FILE = (
    "deepspeedai__DeepSpeedExamples__training__tensor_parallel__hf_integration__configs__"
    "ds_config.json"
)
# What the Trainer writes into the "auto" values (its TrainingArguments defaults, bf16 off).
TRAINER_VALUES = {
    "bf16.enabled": False,
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.total_num_steps": 8,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_max_lr": 1e-3,
    "scheduler.params.warmup_num_steps": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 4,
}
STEPS = 8


def _filled(tensor_parallel: bool) -> dict[str, Any]:
    config = json.loads((Path(PEER_DIR) / AUTOTP_FILE).read_text())
    autos = 0
    for dotted, value in TRAINER_VALUES.items():
        *path, key = dotted.split(".")
        node = config
        for part in path:
            node = node[part]
        assert node[key] == "auto", dotted
        node[key] = value
        autos += 1
    assert autos == 13  # every "auto" of the file
    config["steps_per_print"] = 1000
    if not tensor_parallel:
        config = copy.deepcopy(config)
        del config["tensor_parallel"]
    return config


def _llama() -> torch.nn.Module:
    return tiny_llama(kv_heads=4)


def _train(tensor_parallel: bool) -> list[float]:
    engine, _, _, _ = zerotrain.initialize(model=_llama(), config=_filled(tensor_parallel))
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 12), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_peer_autotp_config_trains_at_tensor_4_like_one_rank():
    reference = run_distributed(_train, 1, False, timeout=180)[0]
    for rank, losses in enumerate(run_distributed(_train, 4, True, timeout=300)):
        worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        assert worst < 1e-5, (rank, losses, reference)
    assert reference[-1] < reference[0]  # it trains


def _error(model_kind: str, config_extra: dict[str, Any], topology: Topology | None) -> str:
    model: torch.nn.Module
    if model_kind == "gpt-2-heads":
        import dataclasses

        model = build_gpt(dataclasses.replace(TP_GPT, n_head=2))
    elif model_kind == "plain":
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    else:
        model = build_gpt(TP_GPT)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **config_extra,
    }
    try:
        zerotrain.initialize(model=model, config=config, topology=topology)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("model", "extra", "topology", "needles"),
    [
        pytest.param(
            "gpt-2-heads",
            {"tensor_parallel": {"autotp_size": 4}},
            None,
            ["'blocks.0.attn' has n_head=2", "whole heads"],
            id="heads",
        ),
        pytest.param(
            "plain",
            {"tensor_parallel": {"autotp_size": 2}},
            None,
            ["no plan says how to split Sequential", "preset_model", "does not guess"],
            id="no-plan",
        ),
        pytest.param(
            "gpt",
            {"tensor_parallel": {"autotp_size": 2, "preset_model": "falcon"}},
            None,
            ["preset_model='falcon' is not a known layout", "gpt, llama"],
            id="preset",
        ),
        pytest.param(
            "gpt",
            {
                "tensor_parallel": {"autotp_size": 2},
                "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
            },
            None,
            ["optimizer.type=Lamb with tensor parallelism", "trust ratios"],
            id="lamb",
        ),
        pytest.param(
            "gpt",
            {"tensor_parallel": {"autotp_size": 2}},
            Topology(data=2, tensor=1),
            ["tensor axis of 1", "autotp_size is 2"],
            id="topology",
        ),
        pytest.param(
            "gpt",
            {"tensor_parallel": {"autotp_size": 2, "plan": {"wte": "diagonal"}}},
            None,
            ["'wte': unknown style 'diagonal'", "colwise"],
            id="style",
        ),
    ],
)
def test_bad_tensor_parallel_input_is_refused_by_name(model, extra, topology, needles):
    ranks = 4 if model == "gpt-2-heads" else 2
    for message in run_distributed(_error, ranks, model, extra, topology, timeout=120):
        for needle in needles:
            assert needle in message, message
