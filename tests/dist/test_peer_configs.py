"""Every real DeepSpeed config in ../shared/peer-configs either trains as written or fails with
a clear message naming the key (unknown key, "auto" to fill in, template placeholder, or a
feature not implemented yet). The expected outcome of each file is pinned here, so a
regression in either direction shows up. The configs with "auto" values are written for
the Hugging Face Trainer, and train through ZeroTrainTrainer
(tests/integrations/test_transformers_auto_configs.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerotrain
from zerotrain.config import ConfigError, load_config
from zerotrain.config.features import not_implemented
from zerotrain.testing.dist import run_distributed

# The shared corpus next to the checkout when present (it may have grown), else the copy
# kept in tests/data so a fresh clone tests the same files.
_SHARED = Path(__file__).resolve().parents[3] / "shared" / "peer-configs"
_VENDORED = Path(__file__).resolve().parents[1] / "data" / "peer-configs"
PEER_DIR = _SHARED if _SHARED.is_dir() else _VENDORED

TRAINS = "trains"
INIT_ERROR = "init_error"  # valid and implemented, but initialize() rejects it as written
TRAINS_WITH_ATTENTION = "trains_with_attention"  # sparse_attention: needs an attention model
TRAINS_WITH_BLOCKS = "trains_with_blocks"  # random-LTD: needs a model with its 24 blocks
# file -> (outcome, substrings the message must contain)
EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "LambdaLabsML__distributed-training-guide__05-sharding-deepspeed__ds_config.json": (TRAINS, ()),
    # As written it needs the Hugging Face Trainer's "auto" values; filled in, it trains at
    # autotp_size 4 (tests/dist/test_tensor_parallel_config.py).
    "deepspeedai__DeepSpeedExamples__training__tensor_parallel__hf_integration__configs__ds_config.json": (
        "config_error",
        ('optimizer.params.lr: is "auto"', "scheduler.params.total_num_steps", "gradient_clipping"),
    ),
    # Their comms_config and monitor_config (DeepSpeed ignores both) are dropped with a
    # warning (below); gradient_clipping "auto" is for the Hugging Face Trainer to fill in.
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json": (
        "config_error",
        ('gradient_clipping: is "auto"',),
    ),
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_offload_config.json": (
        "config_error",
        ('gradient_clipping: is "auto"',),
    ),
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage1_config.json": (
        "config_error",
        ('optimizer.params.lr: is "auto"', "scheduler.params.warmup_num_steps"),
    ),
    "huggingface__accelerate__examples__deepspeed_config_templates__zero_stage3_offload_config.json": (
        "config_error",
        ('optimizer.params.lr: is "auto"',),
    ),
    "huggingface__transformers__tests__deepspeed__ds_config_zero2.json": (
        "config_error",
        ('optimizer.params.lr: is "auto"', 'gradient_clipping: is "auto"'),
    ),
    # Stage 3 with offload_optimizer and offload_param on the CPU.
    # No batch size (Hugging Face's trainer fills it in): initialize says so.
    "huggingface__transformers__tests__deepspeed__ds_config_zero3.json": (
        INIT_ERROR,
        ("no batch size given",),
    ),
    "lm-sys__FastChat__playground__deepspeed_config_s3.json": (
        INIT_ERROR,
        ("no batch size given",),
    ),
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__curriculum_learning__ds_zero_stage_2_config_curriculum_fixed_linear.json": (
        "config_error",
        (
            "line 34",
            "'CONFIG_CL_MIN'",
            "placeholder",
            "'CONFIG_CL_MAX' (line 35)",
            "'CONFIG_CL_DURATION' (line 38)",
        ),
    ),
    "microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json": (
        "config_error",
        (
            "zero_optimization.stage3_param_persitance_threshold",
            "did you mean 'stage3_param_persistence_threshold'?",
        ),
    ),
    # OneCycle with stairs and a post-cycle decay (tests/unit/test_cyclic_schedules.py).
    "microsoft__DeepSpeedExamples__QANet-Pytorch__ds_bsz512_1cycle.json": (TRAINS, ()),
    # 1-bit Adam with fp16; trains on 2 and 4 ranks (also below).
    "microsoft__DeepSpeedExamples__bing_bert__1-bit_adam__nccl__deepspeed_bsz4k_onebitadam_config_seq128_nccl.json": (
        TRAINS,
        (),
    ),
    "microsoft__DeepSpeedExamples__bing_bert__deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": (
        TRAINS,
        (),
    ),
    # Its sparse_attention section needs a model with attention: a tiny BERT (below).
    "microsoft__DeepSpeedExamples__bing_bert__deepspeed_bsz64k_lamb_config_seq128.json": (
        TRAINS_WITH_ATTENTION,
        (),
    ),
    "microsoft__DeepSpeedExamples__cifar__ds_config.json": (
        "not_implemented",
        ("fp16.fp16_master_weights_and_grads",),
    ),
    "microsoft__DeepSpeedExamples__cifar__ds_config_onebitlamb.json": (TRAINS, ()),
    "microsoft__DeepSpeedExamples__pipeline_parallelism__ds_config.json": (TRAINS, ()),
    # random-LTD on 22 of 24 layers: needs a 24-block transformer (a tiny GPT-2, below).
    "microsoft__DeepSpeedExamples__training__data_efficiency__gpt_finetuning__config__ds_config_gpt_medium_random_ltd.json": (
        TRAINS_WITH_BLOCKS,
        (),
    ),
    # Its cuda_visible_devices (DeepSpeed ignores it) is dropped with a warning (below).
    "microsoft__DeepSpeedExamples__training__imagenet__config__ds_fp16_z1_config.json": (
        TRAINS,
        (),
    ),
    "microsoft__DeepSpeed__DeepSpeedExamples__gan__gan_deepspeed_config.json": (TRAINS, ()),
    "microsoft__Megatron-DeepSpeed__ds_zero2_config_bf16.json": (TRAINS, ()),
    "microsoft__Megatron-DeepSpeed__examples__MoE__ds_config_gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4.json": (
        TRAINS,
        (),
    ),
    "microsoft__Megatron-DeepSpeed__examples__ds_config.json": (TRAINS, ()),
    "microsoft__Megatron-DeepSpeed__examples_deepspeed__sequence_parallel__ds_config_gbs16_mbs1_log1_zero3.json": (
        TRAINS,
        (),
    ),
}


def _peer_files() -> list[str]:
    return sorted(p.name for p in PEER_DIR.glob("*.json"))


def test_every_peer_config_has_a_pinned_outcome():
    assert set(_peer_files()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_peer_config_outcome(name):
    outcome, needles = EXPECTED[name]
    path = PEER_DIR / name
    if outcome == "config_error":
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        message = str(info.value)
    else:
        cfg = load_config(str(path))
        message = "\n".join(not_implemented(cfg))
        if outcome in (TRAINS, INIT_ERROR, TRAINS_WITH_ATTENTION, TRAINS_WITH_BLOCKS):
            assert message == ""
        else:
            assert message, f"{name} should need an unbuilt feature"
    if outcome == INIT_ERROR:
        message = "\n".join(run_distributed(_initialize_error, 2, str(path)))
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    # Implemented features are never reported as missing.
    done_features = ("zero_optimization.stage=", "fp16.enabled", "bf16.enabled")
    if outcome != "config_error":  # a config error may list every section as valid keys
        done_features += ("activation_checkpointing", "flops_profiler", "comms_logger", "offload")
    for done in done_features:
        assert done not in message


# Top-level keys DeepSpeed ignores: dropped with a warning naming the nearest known key.
IGNORED_WITH_A_WARNING = {
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json": {
        "comms_config": "comms_logger",
        "monitor_config": "csv_monitor",
    },
    "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z3_offload_config.json": {
        "comms_config": "comms_logger",
        "monitor_config": "csv_monitor",
    },
    "microsoft__DeepSpeedExamples__training__imagenet__config__ds_fp16_z1_config.json": {
        "cuda_visible_devices": "non_finite_gradients",
    },
}


@pytest.mark.parametrize("name", sorted(IGNORED_WITH_A_WARNING))
def test_top_level_keys_deepspeed_ignores_are_warned_about_or_refused_when_strict(name, caplog):
    raw = json.loads((PEER_DIR / name).read_text())
    for value in ("gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu"):
        if raw.get(value) == "auto":  # what the Hugging Face Trainer fills in
            raw[value] = 1.0 if value == "gradient_clipping" else 8
    raw["gradient_accumulation_steps"] = 1
    for section in ("fp16", "bf16"):
        if raw.get(section, {}).get("enabled") == "auto":
            raw[section]["enabled"] = False
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        load_config(raw)
    for key, nearest in IGNORED_WITH_A_WARNING[name].items():
        assert f"ignoring unknown top-level key '{key}'; the nearest known key is '{nearest}'" in (
            caplog.text
        )
    with pytest.raises(ConfigError) as refused:
        load_config({**raw, "zerotrain": {"strict_config": True}})
    for key in IGNORED_WITH_A_WARNING[name]:
        assert f"unknown key '{key}'" in str(refused.value)


def _initialize_error(path: str) -> str:
    model = torch.nn.Linear(8, 1)
    try:
        zerotrain.initialize(model=model, config=path)
    except ConfigError as error:
        return str(error)
    return "initialize accepted it"


def _train_with(path: str) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = zerotrain.initialize(model=model, config=path)
    micro = engine.train_micro_batch_size_per_gpu()
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x = torch.randn(micro, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    assert engine.global_steps == 2
    return losses


@pytest.mark.parametrize("name", sorted(n for n, (o, _) in EXPECTED.items() if o == TRAINS))
def test_trainable_peer_configs_train_as_written(name):
    for losses in run_distributed(_train_with, 2, str(PEER_DIR / name)):
        assert all(torch.isfinite(torch.tensor(losses)))


def _train_bert_with(path: str) -> dict:
    import json

    transformers = pytest.importorskip("transformers")
    # As written except the 64K global batch, which only sets 512 accumulation steps per
    # rank (batch arithmetic has its own tests): 256 gives 2 and a CI-sized run.
    ds_config = json.loads(Path(path).read_text())
    ds_config["train_batch_size"] = 2 * ds_config["train_micro_batch_size_per_gpu"] * 2
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    engine, _, _, _ = zerotrain.initialize(model=model, config=ds_config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        ids = torch.randint(0, 64, (micro, 32), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    assert engine.global_steps == 1
    return {"losses": losses, "attention": model.config._attn_implementation}


def test_sparse_attention_peer_config_trains_a_bert():
    # fp16, LAMB, and the fixed layout with a global pattern per head swapped into BERT.
    (name,) = [n for n, (o, _) in EXPECTED.items() if o == TRAINS_WITH_ATTENTION]
    for result in run_distributed(_train_bert_with, 2, str(PEER_DIR / name), timeout=240):
        assert result["attention"] == "zerotrain_block_sparse"
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def _train_gpt2_with(path: str) -> dict:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # 24 blocks as the config's total_layer_num says; sequences of 160 tokens, so its first
    # kept length (128) drops tokens in layers 1-22.
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=160, n_embd=16, n_layer=24, n_head=2
    )
    model = transformers.GPT2LMHeadModel(config)
    engine, _, _, _ = zerotrain.initialize(model=model, config=path)
    seen: list[int] = []
    model.transformer.h[5].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args or (kwargs["hidden_states"],))[0].shape[1]),
        with_kwargs=True,
    )
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 64, (engine.train_micro_batch_size_per_gpu(), 160), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"losses": losses, "seen": seen}


def test_random_ltd_peer_config_trains_a_gpt2():
    (name,) = [n for n, (o, _) in EXPECTED.items() if o == TRAINS_WITH_BLOCKS]
    for result in run_distributed(_train_gpt2_with, 2, str(PEER_DIR / name), timeout=240):
        assert result["seen"] == [128, 128]  # layer 5 saw the kept tokens only
        assert all(torch.isfinite(torch.tensor(result["losses"])))


def _train_gpt_with_curriculum(path: str) -> list[int]:
    import json

    from zerotrain.examples.gpt import GPT, GPTConfig

    # The placeholders filled in (the file's total_step is the legacy alias); its 512-sample
    # batch shrunk to 2 per rank (batch arithmetic has its own tests).
    text = Path(path).read_text()
    for word, value in (
        ("CONFIG_CL_MIN", "8"),
        ("CONFIG_CL_MAX", "16"),
        ("CONFIG_CL_DURATION", "4"),
    ):
        text = text.replace(word, value)
    config = json.loads(text)
    config["train_batch_size"] = 4
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False))
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    seen: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        x = torch.randint(0, 256, (2, 17), generator=gen)
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    return seen


def test_curriculum_peer_config_trains_once_its_placeholders_are_filled():
    name = next(n for n in EXPECTED if "curriculum_fixed_linear" in n)
    for seen in run_distributed(_train_gpt_with_curriculum, 2, str(PEER_DIR / name)):
        # fixed_linear 8 -> 16 over 4 steps in multiples of 8, evaluated at step + 1.
        assert seen == [8, 8, 8, 16, 16]


ONE_BIT = [n for n in sorted(EXPECTED) if "onebit" in n]


@pytest.mark.parametrize("name", ONE_BIT)
def test_one_bit_peer_configs_train_on_4_ranks(name):
    assert len(ONE_BIT) == 2
    for losses in run_distributed(_train_with, 4, str(PEER_DIR / name)):
        assert all(torch.isfinite(torch.tensor(losses)))
