"""Shared pieces of the parity tests: a tiny GPT, deterministic global batches, a zerotrain
training loop (run on every rank) and the single-process reference it must match."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zerotrain
from zerotrain.examples.corpus import load_corpus
from zerotrain.examples.gpt import GPT, GPTConfig, param_groups

# No biases: the attention key bias has an identically zero gradient (softmax ignores a
# constant added to every key), so Adam turns its pure rounding noise into lr-sized steps
# and the comparison would measure noise amplification instead of zerotrain.
TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
# The demo's GPT at a size two CPU cores train 100 steps of in seconds; 2048 tokens per
# step, so a step's loss is not dominated by a handful of tokens (the bf16 curves of
# tests/dist/test_precision.py and benchmarks/bf16_curves.py).
DEMO_GPT = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False)
DEMO_RUN: dict[str, Any] = {
    "model": DEMO_GPT,
    "micro_batch": 8,
    "opt_params": {"lr": 1e-3, "weight_decay": 0.01},
}


def zero_section(stage: int) -> dict[str, Any]:
    """``zero_optimization`` for ``stage`` with small buckets; at stage 3 every unit
    partitioned (the tiny GPTs' blocks are below the default persistence threshold)."""
    if stage == 3:
        return {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000}
    return {"stage": stage, "reduce_bucket_size": 4000}


# Adam amplifies rounding noise in gradients near eps into lr-sized moves, so the summation
# order alone (even plain PyTorch on the same batch split into chunks) moves parameters of
# this tiny model by ~1.5e-5 at lr 3e-3 with eps 1e-6, and by ~3e-7 at lr 1e-3: these
# settings keep that noise floor 30x under the parity tests' 1e-5 tolerance.
PARITY_ADAM = {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6}


@dataclass(frozen=True)
class RunSpec:
    """One training run: optimizer, batch layout, and what the model looks like."""

    optimizer: str = "Adam"
    opt_params: dict[str, Any] = field(default_factory=lambda: {"lr": 3e-3, "weight_decay": 0.01})
    steps: int = 20
    micro_batch: int = 2
    grad_accum: int = 2
    clip: float = 1.0
    two_groups: bool = False
    freeze: str | None = None  # name of a parameter to freeze
    stage: int = 0
    extra_config: dict[str, Any] = field(default_factory=dict)
    model: GPTConfig = TINY


def make_model(spec: RunSpec, cfg: GPTConfig | None = None) -> GPT:
    # ZEROTRAIN_TEST_RANK_SEED=1 gives every rank different initial weights: training must
    # still match the reference built from rank 0's weights (which initialize broadcasts).
    offset = 0
    if os.environ.get("ZEROTRAIN_TEST_RANK_SEED") and dist.is_initialized():
        offset = dist.get_rank()
    torch.manual_seed(1234 + offset)
    model = GPT(cfg or spec.model)
    if spec.freeze:
        dict(model.named_parameters())[spec.freeze].requires_grad_(False)
    return model


def global_batches(spec: RunSpec, world_size: int, cfg: GPTConfig | None = None) -> torch.Tensor:
    """Token windows of shape (steps, global_batch, block_size + 1), from the real corpus."""
    cfg = cfg or spec.model
    data = torch.frombuffer(bytearray(load_corpus()[:200_000]), dtype=torch.uint8).long()
    global_batch = spec.micro_batch * spec.grad_accum * world_size
    gen = torch.Generator().manual_seed(99)
    starts = torch.randint(
        0, len(data) - cfg.block_size - 1, (spec.steps, global_batch), generator=gen
    )
    offsets = torch.arange(cfg.block_size + 1)
    return data[starts[..., None] + offsets]


def micro_batch(batches: torch.Tensor, spec: RunSpec, step: int, micro: int, rank: int, world: int):
    """The samples rank ``rank`` uses in micro-step ``micro`` of ``step``."""
    start = (micro * world + rank) * spec.micro_batch
    window = batches[step, start : start + spec.micro_batch]
    return window[:, :-1], window[:, 1:]


def zerotrain_config(spec: RunSpec, world_size: int) -> dict[str, Any]:
    return {
        "train_batch_size": spec.micro_batch * spec.grad_accum * world_size,
        "gradient_accumulation_steps": spec.grad_accum,
        "gradient_clipping": spec.clip,
        "optimizer": {"type": spec.optimizer, "params": dict(spec.opt_params)},
        "zero_optimization": {"stage": spec.stage, "reduce_bucket_size": 4000},
        "steps_per_print": 1000,
        **spec.extra_config,
    }


def train_steps(engine: zerotrain.Engine, spec: RunSpec, first: int, last: int) -> list[float]:
    """Runs on every rank: train steps ``first..last-1`` on this rank's share of the global
    batches (the same samples per step for any world size with the same global batch);
    returns each step's global mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    losses = []
    for step in range(first, last):
        total = 0.0
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        losses.append(engine.comm.all_reduce_floats([total])[0] / (world * spec.grad_accum))
    return losses


def run_training(engine: zerotrain.Engine, spec: RunSpec, model: torch.nn.Module) -> dict:
    """Runs on every rank: train ``spec.steps`` steps on this rank's share of the global
    batches; returns per-step global losses, the final parameters and the learning rates
    (``lr``: the last step's; ``current_lr``: the groups' now, DeepSpeed's ``get_lr``)."""
    losses = train_steps(engine, spec, 0, spec.steps)
    with zerotrain.zero.GatheredParameters(model.parameters()):  # whole at stage 3
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "lr": engine.get_lr_of_last_step(),
        "current_lr": engine.get_lr(),
    }


def train_zerotrain(spec: RunSpec) -> dict[str, Any]:
    """Runs on every rank: build the tiny GPT and engine for ``spec`` and train it."""
    model = make_model(spec)
    groups = (
        param_groups(model, spec.opt_params.get("weight_decay", 0.0)) if spec.two_groups else None
    )
    engine, _, _, _ = zerotrain.initialize(
        model=model, model_parameters=groups, config=zerotrain_config(spec, dist.get_world_size())
    )
    return run_training(engine, spec, model)


class ReferenceLamb(torch.optim.Optimizer):
    """LAMB written per parameter from DeepSpeed's fused kernel (moments not bias-corrected,
    trust ratio on ``m / (sqrt(v) + eps) + wd * w``, bias correction folded into the step
    size), as an independent check of zerotrain's flat implementation."""

    def __init__(
        self,
        params,
        lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
    ):
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["t"] += 1
                t, m, v = state["t"], state["m"], state["v"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm().item(), update.norm().item()
                ratio = 1.0
                if w_norm > 0 and u_norm > 0:
                    ratio = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                step_size = group["lr"] * (1 - b2**t) ** 0.5 / (1 - b1**t)
                p.add_(update, alpha=-step_size * ratio)


def reference_optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    p = dict(spec.opt_params)
    name = spec.optimizer.lower()
    if name in ("adam", "adamw"):
        decoupled = name == "adamw" or p.pop("adam_w_mode", True)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(
            params, lr=p["lr"], weight_decay=p.get("weight_decay", 0.0), eps=p.get("eps", 1e-8)
        )
    if name == "sgd":
        return torch.optim.SGD(params, **p)
    if name == "lamb":
        return ReferenceLamb(params, **p)
    raise ValueError(name)


def train_reference(spec: RunSpec, world_size: int) -> dict[str, Any]:
    """The same training in one process on the whole global batch, with plain PyTorch."""
    model = make_model(spec)
    groups = (
        param_groups(model, spec.opt_params.get("weight_decay", 0.0))
        if spec.two_groups
        else [p for p in model.parameters() if p.requires_grad]
    )
    opt = reference_optimizer(spec, groups)
    batches = global_batches(spec, world_size)
    losses = []
    for step in range(spec.steps):
        x, y = batches[step, :, :-1], batches[step, :, 1:]
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        if spec.clip > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], spec.clip
            )
        opt.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def assert_matches(result: dict[str, Any], reference: dict[str, Any], tol: float = 1e-5) -> None:
    losses, ref_losses = result["losses"], reference["losses"]
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    assert worst <= tol, f"loss differs by {worst:.2e} (> {tol}): {losses} vs {ref_losses}"
    assert not any(math.isnan(x) for x in losses)
    for name, ref in reference["params"].items():
        got = result["params"][name]
        diff = (got - ref).abs().max().item()
        assert diff <= tol, f"parameter {name} differs by {diff:.2e} (> {tol})"
