"""Activation checkpointing under the engine: gradients bitwise equal to training without it
(dropout 0.1, so the recomputation must replay the RNG), at stage 0 and inside stage-3 units
whose parameters are released between the forward pass and the recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, global_batches, micro_batch
from zerotrain import checkpointing
from zerotrain.examples.gpt import GPT, Block, GPTConfig
from zerotrain.testing.dist import run_distributed

# The demo's model (examples/train_gpt.py defaults), with dropout on.
DEMO_GPT = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=192, dropout=0.1)
SPEC = RunSpec(steps=2, micro_batch=2, grad_accum=2, model=DEMO_GPT)


class InnerRegionBlock(Block):
    """A block that checkpoints only its attention half, from inside its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + checkpointing.checkpoint(lambda h: self.attn(self.ln1(h)), x)
        return x + self.mlp(self.ln2(x))


class PairRegionGPT(GPT):
    """One checkpointed region spanning two blocks (two stage-3 units)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for i in range(0, len(self.blocks), 2):
            x = checkpointing.checkpoint(
                lambda h, a, b: b(a(h)), x, self.blocks[i], self.blocks[i + 1]
            )
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(how: str) -> GPT:
    torch.manual_seed(5)
    model = (PairRegionGPT if how == "pairs" else GPT)(DEMO_GPT)
    if how == "inner":
        for block in model.blocks:
            block.__class__ = InnerRegionBlock
    return model


def _grads(stage: int, how: str) -> dict:
    """Runs on every rank: two optimizer steps of two micro-steps each; this rank's reduced
    gradients at each boundary, the losses, the final parameters and the RNG afterwards."""
    model = _model(how)
    section = {"block_types": "auto"} if how == "config" else {}
    config = {
        "train_micro_batch_size_per_gpu": SPEC.micro_batch,
        "gradient_accumulation_steps": SPEC.grad_accum,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"profile": True, **section},
    }
    torch.manual_seed(100 + dist.get_rank())  # dropout masks differ per rank, as in training
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.activation_checkpointing.reset_stats()  # the engine's own counters
    engine.reset_comm_stats()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(SPEC, world)
    losses, grads = [], []
    for step in range(SPEC.steps):
        for micro in range(SPEC.grad_accum):
            x, y = micro_batch(batches, SPEC, step, micro, rank, world)
            losses.append(engine.backward(engine(x, y)).item())
            if engine.is_gradient_accumulation_boundary():
                grads.append([g.clone() for g in engine.strategy.reduced_grads()])
            engine.step()
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = engine.activation_checkpointing.stats
    traffic = engine.comm_stats()
    wrapped = [checkpointing.is_checkpointed(b) for b in model.blocks]
    engine.destroy()
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "rng": torch.rand(4),
        "stats": stats,
        "traffic": [traffic.get(purpose=p).bytes for p in ("parameters", "gradients")],
        "wrapped": wrapped,
        "unwrapped_after_destroy": not any(checkpointing.is_checkpointed(b) for b in model.blocks),
    }


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert torch.equal(x, y)
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name
    assert torch.equal(a["rng"], b["rng"])  # the recomputation left the RNG where it was
    # Recomputing at stage 3 gathers nothing more: the unit is gathered for its backward.
    assert a["traffic"] == b["traffic"]


@pytest.mark.parametrize("stage", [0, 3])
def test_every_block_checkpointed_from_config_gives_bitwise_identical_gradients(stage):
    plain = run_distributed(_grads, 2, stage, "none")
    checkpointed = run_distributed(_grads, 2, stage, "config")
    for a, b in zip(plain, checkpointed, strict=True):
        _assert_bitwise(a, b)
        assert b["wrapped"] == [True] * DEMO_GPT.n_layer
        assert b["unwrapped_after_destroy"]
        # 4 blocks x 4 micro-steps, each run once forward and recomputed once in backward.
        assert b["stats"].calls == b["stats"].recomputes == 16
        assert b["stats"].kept_bytes == 16 * SPEC.micro_batch * 128 * 192 * 4
        assert b["stats"].forward_seconds > 0
        assert b["stats"].recompute_seconds > 0
        assert a["stats"].calls == 0


@pytest.mark.parametrize("how", ["inner", "pairs"])
def test_regions_inside_and_across_stage3_units_give_bitwise_identical_gradients(how):
    # The units are released after their forward; the recomputation gathers them again.
    # "inner": the region is half a unit's forward; "pairs": one region spans two units.
    reference = run_distributed(_grads, 2, 3, "none")
    checkpointed = run_distributed(_grads, 2, 3, how)
    for a, b in zip(reference, checkpointed, strict=True):
        _assert_bitwise(a, b)
        assert b["stats"].recomputes == b["stats"].calls > 0


def _transformers_losses(checkpointed: bool) -> dict:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.1
    )
    model = transformers.GPT2LMHeadModel(config)
    section = {"activation_checkpointing": {"block_types": ["GPT2Block"]}} if checkpointed else {}
    engine, *_ = zerotrain.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            **section,
        },
    )
    torch.manual_seed(7 + dist.get_rank())
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(3):
        losses.append(engine.backward(engine(input_ids=ids, labels=ids).loss).item())
        engine.step()
    return {"losses": losses, "use_cache": model.config.use_cache}


def test_hugging_face_model_checkpointed_by_config_trains_identically():
    plain = run_distributed(_transformers_losses, 2, False)
    checkpointed = run_distributed(_transformers_losses, 2, True)
    for a, b in zip(plain, checkpointed, strict=True):
        assert a["losses"] == b["losses"]
        assert not b["use_cache"]  # a layer's cache would be filled again by recomputation


def test_checkpointing_composes_with_bf16_and_stage2():
    plain = run_distributed(_bf16_losses, 2, False)
    checkpointed = run_distributed(_bf16_losses, 2, True)
    for a, b in zip(plain, checkpointed, strict=True):
        assert a == b


def _bf16_losses(checkpointed: bool) -> list[float]:
    model = _model("none")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "activation_checkpointing": {"block_types": ["Block"]} if checkpointed else {},
    }
    torch.manual_seed(3 + dist.get_rank())
    engine, *_ = zerotrain.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(SPEC, world)
    losses = []
    for step in range(2):
        x, y = micro_batch(batches, SPEC, step, 0, rank, world)
        losses.append(engine.backward(engine(x, y)).item())
        engine.step()
    return losses
