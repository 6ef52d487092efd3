"""The estimator's per-rank prediction against ``engine.memory_breakdown()`` of real engines:
stages 0-3 x fp32/bf16 x 1, 2 and 4 ranks, for a GPT (padding a small fraction) and for a
model of odd little layers in small buckets (padding a large fraction)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.engine.accounting import MemoryBreakdown
from zerotrain.estimate import estimate_memory
from zerotrain.estimate.layout import estimate_rank_memory
from zerotrain.examples.gpt import GPT, GPTConfig, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.parallel import Topology
from zerotrain.pipe import PipelineModule
from zerotrain.testing.dist import run_distributed

# Blocks of ~111k parameters: above the stage-3 persistence threshold (100k), so blocks are
# gathered and freed; biases give odd sizes, so units need padding.
GPT_SHAPE = GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=96)
CATEGORIES = (
    "params",
    "grads",
    "master_weights",
    "optimizer_states",
    "buffers",
    "gathered",
    "staging",
)


def _odd_model() -> nn.Module:
    # Repeated Linear layers of awkward sizes: each is a stage-3 unit (and a bucket of its
    # own at reduce_bucket_size 16), so padding is up to a tenth of the parameters at N=4.
    sizes = [7, 3, 5, 2, 9, 1]
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(sizes)))


def _build(kind: str) -> nn.Module:
    return GPT(GPT_SHAPE) if kind == "gpt" else _odd_model()


def _loss(kind: str, model_out: Any) -> torch.Tensor:
    return model_out if kind == "gpt" else model_out.float().pow(2).mean()


def _batch(kind: str, rank: int) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(rank)
    if kind == "gpt":
        tokens = torch.randint(0, 256, (2, GPT_SHAPE.block_size + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return (torch.randn(4, 7, generator=gen),)


def _breakdown_after_one_step(kind: str, zero: dict[str, Any], dtype: str) -> MemoryBreakdown:
    """On every rank: the engine's memory breakdown after one Adam step of a fresh model."""
    torch.manual_seed(0)
    model = _build(kind)
    config = {
        "train_batch_size": dist.get_world_size(),
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.backward(_loss(kind, engine(*_batch(kind, dist.get_rank()))))
    engine.step()
    measured = engine.memory_breakdown()
    engine.destroy()
    return measured


def _predicted_vs_measured(kind: str) -> list[dict[str, Any]]:
    """On every rank: one training step per (stage, dtype); both sides' bytes per category."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bucket = 16 if kind == "odd" else None
    results = []
    for stage in (0, 1, 2, 3):
        for dtype in ("fp32", "bf16"):
            with torch.device("meta"):
                shape_model = _build(kind)
            predicted = estimate_memory(
                shape_model,
                world_size=world,
                stage=stage,
                dtype=dtype,
                device="cpu",
                rank=rank,
                bucket_numel=bucket,
            )
            zero: dict[str, Any] = {"stage": stage}
            if bucket is not None:
                zero["reduce_bucket_size"] = bucket
            measured = _breakdown_after_one_step(kind, zero, dtype).as_dict()
            results.append(
                {
                    "stage": stage,
                    "dtype": dtype,
                    "predicted": {c: predicted.category(c).total for c in CATEGORIES},
                    "measured": {c: measured[c] for c in CATEGORIES},
                }
            )
    return results


def _relative_error(predicted: int, measured: int) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return abs(predicted - measured) / measured


@pytest.mark.parametrize("kind", ["gpt", "odd"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_prediction_matches_memory_breakdown(world_size: int, kind: str) -> None:
    worst = 0.0
    for rank, results in enumerate(run_distributed(_predicted_vs_measured, world_size, kind)):
        for r in results:
            where = f"rank {rank} stage {r['stage']} {r['dtype']}"
            for c in CATEGORIES:
                err = _relative_error(r["predicted"][c], r["measured"][c])
                worst = max(worst, err)
                # Model states are predicted to the byte; the stage-3 working set and the
                # staging buffers depend on hook order only in ways the plan reproduces.
                assert err == 0.0, (where, c, r["predicted"][c], r["measured"][c])
            total_p, total_m = sum(r["predicted"].values()), sum(r["measured"].values())
            assert _relative_error(total_p, total_m) <= 0.05, (where, total_p, total_m)
    assert worst <= 0.05


def _offloaded_predicted_vs_measured(swap_root: str) -> list[dict[str, Any]]:
    """NVMe offload of optimizer and parameters (everything swapped: max_in_cpu 0), stages
    2 and 3, fp32 and bf16: what stays in memory, and what the swap files hold."""
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for stage, dtype in itertools.product((2, 3), ("fp32", "bf16")):
        with torch.device("meta"):
            shape_model = _build("gpt")
        offload = {"offload_optimizer": "nvme", "offload_param": "nvme" if stage == 3 else "none"}
        predicted = estimate_memory(
            shape_model,
            world_size=world,
            stage=stage,
            dtype=dtype,
            device="cpu",
            rank=rank,
            max_in_cpu=0,
            **offload,
        )
        swap = {"nvme_path": swap_root}
        zero = {
            "stage": stage,
            "offload_optimizer": {"device": "nvme", **swap},
            "offload_param": {"device": offload["offload_param"], "max_in_cpu": 0, **swap},
        }
        measured = _breakdown_after_one_step("gpt", zero, dtype)
        results.append(
            {
                "where": f"stage {stage} {dtype}",
                "predicted": {c: predicted.category(c).total for c in CATEGORIES},
                "predicted_memory": {
                    c: predicted.category(c).device + predicted.category(c).cpu for c in CATEGORIES
                },
                "predicted_nvme": predicted.nvme_total,
                "measured": {c: measured.as_dict()[c] for c in CATEGORIES},
                "measured_nvme": measured.nvme,
            }
        )
    return results


def test_offload_prediction_matches_memory_breakdown(tmp_path) -> None:
    """What NVMe offload leaves in memory is predicted to the byte; the swap files hold
    what the prediction moves there, plus each region's 4 KiB alignment."""
    ranks = run_distributed(_offloaded_predicted_vs_measured, 2, str(tmp_path))
    for rank, results in enumerate(ranks):
        for r in results:
            where = f"rank {rank} {r['where']}"
            for c in CATEGORIES:
                assert r["predicted_memory"][c] == r["measured"][c], (where, c, r)
            nvme, disk = r["predicted_nvme"], r["measured_nvme"]
            assert nvme > 0, where
            assert nvme <= disk <= nvme * 1.05 + (64 << 10), (where, nvme, disk)


LAYOUTS = {
    "tp2xdp2": Topology(data=2, tensor=2),
    "sp2xdp2": Topology(data=2, sequence=2),
    "pp2xtp2": Topology(pipe=2, tensor=2),
}


def _layout_engine(topology: Topology, stage: int) -> Any:
    """A GPT engine on ``topology`` after one step (a pipeline: the layer list, split by
    AutoTP's preset)."""
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "sequence_parallel_size": topology.sequence,
    }
    tokens = torch.randint(0, 256, (2, 1, GPT_SHAPE.block_size + 1))
    pairs = [(t[:, :-1], t[:, 1:]) for t in tokens]
    if topology.pipe > 1:
        config["pipeline"] = {"stages": topology.pipe}
        config["tensor_parallel"] = {"autotp_size": topology.tensor, "preset_model": "gpt"}
        model = PipelineModule(
            gpt_pipeline_layers(GPT_SHAPE), topology=topology, loss_fn=gpt_loss_fn
        )
        engine, *_ = zerotrain.initialize(model=model, config=config, topology=topology)
        engine.train_batch(iter(pairs))
        return engine
    if topology.tensor > 1:
        config["tensor_parallel"] = {"autotp_size": topology.tensor}
    engine, *_ = zerotrain.initialize(model=GPT(GPT_SHAPE), config=config, topology=topology)
    for x, y in pairs:
        engine.backward(engine(**engine.shard_sequence({"idx": x, "targets": y})))
        engine.step()
    return engine


def _layout_predicted_vs_measured(name: str) -> list[dict[str, Any]]:
    """On every rank of ``LAYOUTS[name]``: stages 0-3, the estimate of this rank's piece
    against its engine's breakdown."""
    topology, rank = LAYOUTS[name], dist.get_rank()
    results = []
    for stage in (0, 1, 2, 3):
        with torch.device("meta"):
            shape = gpt_pipeline_layers(GPT_SHAPE) if topology.pipe > 1 else GPT(GPT_SHAPE)
        predicted = estimate_rank_memory(
            shape,
            topology,
            rank,
            tp_preset="gpt" if topology.pipe > 1 else None,
            stage=stage,
            device="cpu",
        )
        engine = _layout_engine(topology, stage)
        measured = engine.memory_breakdown().as_dict()
        engine.destroy()
        results.append(
            {
                "stage": stage,
                "predicted": {c: predicted.category(c).total for c in CATEGORIES},
                "measured": {c: measured[c] for c in CATEGORIES},
            }
        )
    return results


@pytest.mark.parametrize("name", LAYOUTS)
def test_3d_layout_prediction_matches_memory_breakdown(name: str) -> None:
    """``zerotrain estimate --tp --pp --sp``'s model states, to the byte, on every rank."""
    for rank, results in enumerate(run_distributed(_layout_predicted_vs_measured, 4, name)):
        for r in results:
            for c in CATEGORIES:
                if c == "staging" and r["stage"] == 3 and LAYOUTS[name].pipe > 1:
                    # Stage-3 staging buffers of a pipeline depend on how many micro-batches
                    # the schedule has in flight: not modelled (docs/estimate.md).
                    continue
                where = (name, f"rank {rank}", f"stage {r['stage']}", c)
                assert r["predicted"][c] == r["measured"][c], (where, r["predicted"], r["measured"])
