"""Shared pieces of the pipeline tests: the demo GPT as a PipelineModule, its training on
every rank through ``train_batch``, and the single-process reference it must match."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import PARITY_ADAM, RunSpec, global_batches, micro_batch
from zerotrain.examples.gpt import GPTConfig, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.parallel.topology import Topology
from zerotrain.pipe import PipelineModule

# Enough layers (token embedding, 6 blocks, final norm, tied head = 9) for 4 stages x 2
# virtual stages; no biases, for the reason given in tests/helpers/training.py.
PIPE_GPT = GPTConfig(block_size=16, n_layer=6, n_head=2, n_embd=32, bias=False)
MICRO_BATCHES = 4
SPEC = RunSpec(
    optimizer="AdamW",
    opt_params=dict(PARITY_ADAM),
    steps=20,
    micro_batch=2,
    grad_accum=MICRO_BATCHES,
    clip=0.5,  # active: the gradient norm of this model starts near 2
    model=PIPE_GPT,
)


@dataclasses.dataclass(frozen=True)
class PipeRun:
    """One pipeline configuration."""

    stages: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 1
    grad_reduce: str = "end_of_step"
    reshard_after_forward: bool = True
    steps: int = SPEC.steps
    micro_batches: int = MICRO_BATCHES
    checkpoint_interval: int = 0  # activation checkpointing every this many layers

    def config(self, data_parallel: int) -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": SPEC.micro_batch,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": SPEC.clip,
            "optimizer": {"type": SPEC.optimizer, "params": dict(SPEC.opt_params)},
            "zero_optimization": {
                "stage": self.zero_stage,
                "reduce_bucket_size": 4000,
                "stage3_param_persistence_threshold": 0,
            },
            "pipeline": {
                "stages": self.stages,
                "schedule": self.schedule,
                "virtual_stages": self.virtual_stages,
                "grad_reduce": self.grad_reduce,
                "reshard_after_forward": self.reshard_after_forward,
                "activation_checkpoint_interval": self.checkpoint_interval,
                "seed_layers": True,
            },
            "steps_per_print": 1000,
        }


def pipeline_module(stages: int, virtual_stages: int = 1, **kwargs: Any) -> PipelineModule:
    """The demo GPT as a PipelineModule over this job (or one stage without a job)."""
    topology = None
    if dist.is_initialized():
        topology = Topology.from_world(dist.get_world_size(), pipe=stages)
    return PipelineModule(
        gpt_pipeline_layers(PIPE_GPT),
        num_stages=None if topology is not None else stages,
        topology=topology,
        loss_fn=gpt_loss_fn,
        seed_layers=True,
        virtual_stages=virtual_stages,
        **({"stage_id": 0} if topology is None else {}),
        **kwargs,
    )


SPIKE_STEP = 10  # its targets are random tokens: a loss spike, with clipping hard at work


def pipeline_batches(count: int, data_parallel: int) -> torch.Tensor:
    """Every step's global batch (``count`` micro-batches per replica), with the spike."""
    spec = dataclasses.replace(SPEC, grad_accum=count)
    batches = global_batches(spec, data_parallel).clone()
    noise = torch.Generator().manual_seed(7)
    spiked = batches[SPIKE_STEP, :, 1:]
    spiked.copy_(torch.randint(0, PIPE_GPT.vocab_size, spiked.shape, generator=noise))
    return batches


def micro_batches(
    engine: Any | None, step: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of ``step`` for ``engine``'s data-parallel rank (None: one
    process, the whole global batch of one replica)."""
    rank, world = (
        (0, 1) if engine is None else (engine.groups.data.rank, engine.groups.data.world_size)
    )
    batches = pipeline_batches(count, world)
    spec = dataclasses.replace(SPEC, grad_accum=count)
    return [micro_batch(batches, spec, step, m, rank, world) for m in range(count)]


def stage_params(engine: Any) -> dict[str, torch.Tensor]:
    """This stage's parameters by (global) name, whole."""
    module = engine.module
    with zerotrain.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def train_pipeline(run: PipeRun) -> dict[str, Any]:
    """Runs on every rank: ``run.steps`` steps of ``train_batch``; losses and this stage's
    final parameters."""
    module = pipeline_module(
        run.stages, run.virtual_stages, activation_checkpoint_interval=run.checkpoint_interval
    )
    data_parallel = dist.get_world_size() // run.stages
    engine, _, _, _ = zerotrain.initialize(model=module, config=run.config(data_parallel))
    losses = []
    for step in range(run.steps):
        batches = micro_batches(engine, step, run.micro_batches)
        losses.append(float(engine.train_batch(iter(batches))))
    return {"losses": losses, "params": stage_params(engine)}


def train_reference(
    steps: int = SPEC.steps, data_parallel: int = 1, micro: int = MICRO_BATCHES
) -> dict[str, Any]:
    """One process, the whole global batch, plain PyTorch (AdamW, clipping)."""
    module = pipeline_module(1)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=SPEC.opt_params["lr"],
        weight_decay=SPEC.opt_params["weight_decay"],
        eps=SPEC.opt_params["eps"],
    )
    batches = pipeline_batches(micro, data_parallel)
    losses = []
    for step in range(steps):
        x, y = batches[step, :, :-1], batches[step, :, 1:]
        loss = gpt_loss_fn(module(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, SPEC.clip)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


def mismatches(result: dict[str, Any], reference: dict[str, Any], tol: float) -> list[str]:
    """What differs by more than ``tol`` (empty: a match)."""
    problems = []
    worst = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
    if worst > tol:
        problems.append(f"loss differs by {worst:.2e}: {result['losses']} vs {reference['losses']}")
    for name, value in result["params"].items():
        diff = (value - reference["params"][name]).abs().max().item()
        if diff > tol:
            problems.append(f"parameter {name} differs by {diff:.2e}")
    return problems
