"""Several backward passes per micro-step: ``engine.no_sync()`` and the strategy window's
``set_requires_gradient_sync`` knob.

Backward passes without gradient sync accumulate on each rank; the next pass with sync
reduces everything at once. Gradients must equal single-process accumulation of the same
losses, and the traffic must be one reduction per step, not one per pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import PARITY_ADAM, RunSpec, global_batches, make_model, micro_batch
from zerotrain.testing.dist import run_distributed

PASSES = 3  # backward passes per step; the first PASSES - 1 without sync
SPEC = RunSpec(micro_batch=2, grad_accum=PASSES, clip=0.0, steps=4, opt_params=PARITY_ADAM)


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": SPEC.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": dict(SPEC.opt_params)},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000},
        "steps_per_print": 1000,
    }


def _train(stage: int, order: str) -> dict:
    """``order`` "plain": F0 B0 F1 B1 F2 B2; "1f1b": F0 F1 F2 B0 B1 B2 (forwards of later
    micro-batches outstanding before earlier backwards, as a pipeline stage runs them)."""
    model = make_model(SPEC)
    engine, _, _, _ = zerotrain.initialize(model=model, config=_config(stage))
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(SPEC, world)
    bytes_per_step = []
    for step in range(SPEC.steps):
        engine.reset_comm_stats()
        inputs = [micro_batch(batches, SPEC, step, m, rank, world) for m in range(PASSES)]
        if order == "plain":
            for m, (x, y) in enumerate(inputs):
                if m < PASSES - 1:
                    with engine.no_sync():
                        engine.backward(engine(x, y))
                else:
                    engine.backward(engine(x, y))
        else:
            losses = [engine(x, y) for x, y in inputs]
            with engine.no_sync():
                for loss in losses[:-1]:
                    engine.backward(loss)
            engine.backward(losses[-1])
        engine.step()
        stats = engine.comm_stats().get(purpose="gradients")
        bytes_per_step.append(stats.bytes)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "grad_bytes": bytes_per_step}


def _one_pass_bytes(stage: int) -> int:
    model = make_model(SPEC)
    engine, _, _, _ = zerotrain.initialize(model=model, config=_config(stage))
    x, y = micro_batch(global_batches(SPEC, dist.get_world_size()), SPEC, 0, 0, dist.get_rank(), 2)
    engine.reset_comm_stats()
    engine.backward(engine(x, y))
    engine.step()
    return engine.comm_stats().get(purpose="gradients").bytes


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = make_model(SPEC)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=PARITY_ADAM["lr"],
        weight_decay=PARITY_ADAM["weight_decay"],
        eps=PARITY_ADAM["eps"],
    )
    world = 2
    batches = global_batches(SPEC, world)
    for step in range(SPEC.steps):
        for m in range(PASSES):
            # Each pass's loss is the mean over its micro-batch on every rank: the global
            # mean of pass m over both ranks' samples.
            parts = [micro_batch(batches, SPEC, step, m, r, world) for r in range(world)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("order", ["plain", "1f1b"])
def test_backward_without_sync_accumulates_and_reduces_once(stage: int, order: str) -> None:
    expected = _reference()
    results = run_distributed(_train, 2, stage, order)
    once = run_distributed(_one_pass_bytes, 2, stage)[0]
    for result in results:
        for name, value in expected.items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0)
        assert result["grad_bytes"] == [once] * SPEC.steps


def _misuse() -> str:
    engine, _, _, _ = zerotrain.initialize(model=make_model(SPEC), config=_config(0))
    x, y = micro_batch(global_batches(SPEC, 2), SPEC, 0, 0, dist.get_rank(), 2)
    with engine.no_sync():
        engine.backward(engine(x, y))
        try:
            engine.step()
        except RuntimeError as exc:
            return str(exc)
    return "no error"


def test_step_inside_no_sync_is_refused() -> None:
    for message in run_distributed(_misuse, 2):
        assert "step() called inside engine.no_sync()" in message


class _Chain(torch.nn.Module):
    """Four small blocks (stage-3 units reduced together); ``cut`` detaches the input of
    block 2, which then gets no module backward signal (it is launched last)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, cut: bool = False) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x.detach() if cut and i == 2 else x))
        return self.head(x)


def _chain_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(6)]


def _chain_train() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _Chain()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": dict(PARITY_ADAM)},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    rows = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    batches = _chain_batches()
    for step in range(3):
        (x1, y1), (x2, y2) = batches[2 * step], batches[2 * step + 1]
        with engine.no_sync():
            engine.backward(torch.nn.functional.mse_loss(engine(x1[rows]), y1[rows]))
        engine.backward(torch.nn.functional.mse_loss(engine(x2[rows], cut=True), y2[rows]))
        engine.step()
    with zerotrain.zero.GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_unit_that_loses_its_backward_signal_inside_no_sync() -> None:
    """Stage 3 with small units reduced in batches: the sync pass's detached block changes
    the launch order while the no_sync pass's gradients are staged. The units go alone
    until nothing is staged, then are batched again (this raised an InvariantError when
    the batches were re-planned at once), and training matches plain PyTorch."""
    torch.manual_seed(0)
    model = _Chain()
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    batches = _chain_batches()
    for step in range(3):
        (x1, y1), (x2, y2) = batches[2 * step], batches[2 * step + 1]
        torch.nn.functional.mse_loss(model(x1), y1).backward()
        torch.nn.functional.mse_loss(model(x2, cut=True), y2).backward()
        opt.step()
        opt.zero_grad()
    for result in run_distributed(_chain_train, 2):
        for name, value in model.named_parameters():
            torch.testing.assert_close(result[name], value.detach(), atol=1e-6, rtol=0)
