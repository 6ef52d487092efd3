"""ZeRO stages 0-2 as one mechanism: parity with single-process training, communication
volume per step, memory per rank, overlap with backward, and parameters without gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    micro_batch,
    train_reference,
    train_zerotrain,
    zerotrain_config,
)
from zerotrain.testing.dist import run_distributed


def _spec(stage: int, optimizer: str = "Adam", params: dict | None = None, **kw) -> RunSpec:
    return RunSpec(
        optimizer=optimizer,
        opt_params=params or PARITY_ADAM,
        two_groups=True,
        freeze="blocks.0.ln1.weight",
        stage=stage,
        **kw,
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_stage_matches_single_process_training(stage, world_size):
    """20 steps, accumulation 2, clipping 1.0, two param groups, a frozen parameter; the
    tiny GPT's parameter count does not divide by 3 or 4, so shards are padded."""
    spec = _spec(stage)
    results = run_distributed(train_zerotrain, world_size, spec)
    reference = train_reference(spec, world_size)
    for result in results:
        assert_matches(result, reference)


@pytest.mark.parametrize(
    ("optimizer", "params"),
    [
        ("Lamb", {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-6}),  # norms over shards
        ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ],
)
@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_lamb_and_sgd_match_single_process(stage, optimizer, params):
    spec = _spec(stage, optimizer, params)
    results = run_distributed(train_zerotrain, 3, spec)
    assert_matches(results[0], train_reference(spec, 3))


def test_ranks_seeded_differently_start_from_rank_zero_weights():
    spec = _spec(2, steps=4)
    results = run_distributed(train_zerotrain, 2, spec, env={"ZEROTRAIN_TEST_RANK_SEED": "1"})
    assert_matches(results[1], train_reference(spec, 2))


# -- communication ----------------------------------------------------------------------------


def _comm_per_micro_step(stage: int, grad_accum: int) -> dict[str, object]:
    spec = RunSpec(steps=2, grad_accum=grad_accum, stage=stage)
    model = make_model(spec)
    world = dist.get_world_size()
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, world))
    batches = global_batches(spec, world)
    per_micro = []
    for step in range(spec.steps):
        for micro in range(spec.grad_accum):
            engine.reset_comm_stats()
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), world)
            engine.backward(engine(x, y))
            engine.step()
            snap = engine.comm_stats()
            per_micro.append(
                {
                    "grads": snap.get(purpose="gradients"),
                    "params": snap.get(purpose="parameters"),
                    "control": snap.get(purpose="control"),
                    "ops": sorted({op for op, p in snap.counts if p != "control"}),
                }
            )
    units = engine.strategy.units
    return {
        "per_micro": per_micro,
        "padded_bytes": sum(4 * u.buffer.layout.padded_numel for u in units),
        "param_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
        "units": len(units),
    }


@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_communication_volume_per_step_matches_the_zero_paper(stage, grad_accum):
    for out in run_distributed(_comm_per_micro_step, 3, stage, grad_accum):
        size, units = out["padded_bytes"], out["units"]
        assert units > 1  # the test config's reduce_bucket_size splits the model
        assert size - out["param_bytes"] < 4 * 3 * units  # padding: < world size per unit
        for micro, c in enumerate(out["per_micro"]):
            boundary = micro % grad_accum == grad_accum - 1
            assert c["control"].bytes <= 2 * 8 * 64  # loss/flag/norm scalars only
            if stage == 0:
                # One all-reduce of every gradient (2 x bytes) at the boundary, nothing else.
                assert c["ops"] == (["all_reduce"] if boundary else [])
                assert c["grads"].bytes == (2 * size if boundary else 0)
                assert c["params"].bytes == 0
            elif stage == 1:
                # A reduce-scatter of the gradients and an all-gather of the parameters.
                assert c["grads"].bytes == (size if boundary else 0)
                assert c["params"].bytes == (size if boundary else 0)
            else:
                # Stage 2 keeps no full gradient, so it reduce-scatters every micro-step.
                assert c["grads"].bytes == size
                assert c["params"].bytes == (size if boundary else 0)
            if boundary and stage > 0 and grad_accum == 1:
                total = c["grads"].bytes + c["params"].bytes
                assert total == 2 * size  # the paper's 2 x params for stages 1 and 2


def _reductions_during_backward(stage: int, overlap: bool) -> tuple[int, int]:
    spec = RunSpec(steps=1, grad_accum=1, stage=stage)
    model = make_model(spec)
    world = dist.get_world_size()
    config = zerotrain_config(spec, world)
    config["zero_optimization"]["overlap_comm"] = overlap
    engine, *_ = zerotrain.initialize(model=model, config=config)
    seen: list[int] = []
    # The embedding's backward is among the last things autograd runs.
    model.wte.register_full_backward_hook(
        lambda *_: seen.append(engine.comm_stats().get(purpose="gradients").calls)
    )
    engine.reset_comm_stats()
    x, y = micro_batch(global_batches(spec, world), spec, 0, 0, dist.get_rank(), world)
    engine.backward(engine(x, y))
    return seen[0], len(engine.strategy.units)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradients_are_reduced_while_backward_is_still_running(stage, overlap):
    # overlap_comm: reductions run beside backward; without it each is waited for at once
    # (the CPU default), but they still start from the hooks, unit by unit.
    launched = run_distributed(_reductions_during_backward, 2, stage, overlap)[0]
    launched_before_end, units = launched
    assert 0 < launched_before_end < units


# -- memory -----------------------------------------------------------------------------------


def _memory(stage: int) -> dict[str, int]:
    spec = RunSpec(steps=1, grad_accum=1, stage=stage)
    model = make_model(spec)
    world = dist.get_world_size()
    config = zerotrain_config(spec, world)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x, y = micro_batch(global_batches(spec, world), spec, 0, 0, dist.get_rank(), world)
    engine.backward(engine(x, y))
    engine.step()
    units = engine.strategy.units
    return {
        **engine.memory_breakdown().as_dict(),
        "P": model.num_parameters(),
        "units": len(units),
        "pieces": sum(len(u.pieces) for u in units),
        "bucket": config["zero_optimization"]["reduce_bucket_size"],
        "largest_unit": max(u.buffer.layout.padded_numel for u in units),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_breakdown_follows_the_stage(stage, world_size):
    for out in run_distributed(_memory, world_size, stage):
        p, n, units = out["P"], world_size, out["units"]
        pad = 4 * n * units  # at most n - 1 padding elements per unit, 4 bytes each
        shard = 4 * math.ceil(p / n)
        assert 4 * p <= out["params"] <= 4 * p + pad  # stages 0-2 keep whole parameters
        steps = 4 * out["pieces"]  # Adam's step counter: one 4-byte scalar per piece
        if stage == 0:
            assert out["grads"] == 4 * p
            assert out["optimizer_states"] == 8 * p + steps
        else:
            # Adam: 8 bytes per element, for this rank's shard only (fp32: no master copy).
            assert abs(out["optimizer_states"] - steps - 2 * shard) <= 2 * pad
            if stage == 1:
                assert 4 * p <= out["grads"] <= 4 * p + pad
            else:
                # The owned gradient shard, and apart from it at most one bucket of staging
                # (two buffers of half a bucket; a parameter larger than that gets a unit of
                # its own).
                assert shard <= out["grads"] <= shard + pad
                staging = max(out["bucket"], 2 * out["largest_unit"])
                assert 0 < out["staging"] <= 4 * staging
                assert out["grads"] + out["staging"] < 4 * p  # no full-size gradient kept
        assert out["master_weights"] == 0


# -- parameters without gradients -------------------------------------------------------------


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.a = torch.nn.Linear(8, 1)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return (self.a(h) if head == "a" else self.b(h)).pow(2).mean()


def _heads_schedule(step: int, rank: int) -> str:
    # Step 0 and 3: every rank uses head b (a is unused everywhere); step 1: rank 0 uses b,
    # the others a (both used somewhere); otherwise head a.
    if step in (0, 3):
        return "b"
    if step == 1:
        return "b" if rank == 0 else "a"
    return "a"


def _two_heads(stage: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = _TwoHeads()
    config = {
        "train_batch_size": 2 * dist.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}},
        # One parameter per unit, so an unused head is alone in its pieces and its whole
        # optimizer state (step count included) can be left untouched, as in PyTorch.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randn(2 * dist.get_world_size(), 4, generator=gen)
        mine = x.chunk(dist.get_world_size())[dist.get_rank()]
        engine.backward(engine(mine, _heads_schedule(step, dist.get_rank())))
        engine.step()
    return {n: p.detach().view(-1).tolist() for n, p in model.named_parameters()}


def _two_heads_reference(world: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randn(2 * world, 4, generator=gen)
        opt.zero_grad(set_to_none=True)  # an unused head keeps grad None and is skipped
        loss = sum(model(chunk, _heads_schedule(step, r)) for r, chunk in enumerate(x.chunk(world)))
        (loss / world).backward()
        opt.step()
    return {n: p.detach().view(-1).tolist() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_without_gradient_are_not_updated_like_plain_pytorch(stage):
    got = run_distributed(_two_heads, 2, stage)[0]
    ref = _two_heads_reference(2)
    for name, values in ref.items():
        assert got[name] == pytest.approx(values, abs=1e-5), name


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_matches_over_plain_gloo_collectives(stage):
    # The default CPU path runs collectives through shared memory; this covers gloo's.
    spec = _spec(stage, steps=6)
    results = run_distributed(train_zerotrain, 3, spec, env={"ZEROTRAIN_SHM": "0"})
    assert_matches(results[0], train_reference(spec, 3))


# -- optimizer groups and state across ranks (regressions) -----------------------------------


def _two_group_lamb(stage: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    world = dist.get_world_size()
    config = {
        "train_batch_size": 4 * world,
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-2, 2e-2]}},
        "zero_optimization": {"stage": stage},
    }
    # The small no-decay group lands at the end of the unit: on the last rank only.
    groups = [
        {"params": [model[0].weight, model[1].weight]},
        {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
    ]
    engine, optimizer, _, _ = zerotrain.initialize(
        model=model, model_parameters=groups, config=config
    )
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()
    return {"groups": len(optimizer.param_groups), "lr": engine.get_lr()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_rank_has_every_param_group_even_without_elements_of_it(stage):
    results = run_distributed(_two_group_lamb, 3, stage, comm_timeout=20)
    assert all(r["groups"] == 2 for r in results)
    assert all(r["lr"] == results[0]["lr"] for r in results)


def _user_optimizer_with_zero_grad(stage: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = {"train_batch_size": 2 * dist.get_world_size(), "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = zerotrain.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    with zerotrain.zero.GatheredParameters(model.weight):
        before = model.weight.detach().clone()
    for _ in range(3):
        optimizer.zero_grad()  # torch's default sets .grad to None
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    with zerotrain.zero.GatheredParameters(model.weight):
        return (model.weight.detach() - before).abs().max().item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_optimizers_zero_grad_does_not_stop_training(stage):
    assert all(
        change > 1e-3 for change in run_distributed(_user_optimizer_with_zero_grad, 2, stage)
    )


class _SometimesUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return (self.b(y) if use_b else y).pow(2).mean()


def _sgd_unused_on_first_step(stage: int, reference: bool) -> dict:
    torch.manual_seed(0)
    model = _SometimesUnused()
    hyper = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    world, rank = (1, 0) if reference else (dist.get_world_size(), dist.get_rank())
    if reference:
        opt = torch.optim.SGD(model.parameters(), **hyper)
    else:
        config = {
            "train_batch_size": 4,
            "optimizer": {"type": "SGD", "params": hyper},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zerotrain.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 4, generator=gen).chunk(world)[rank]
        if reference:
            opt.zero_grad()
            model(x, step != 0).backward()
            opt.step()
        else:
            engine.backward(engine(x, step != 0))
            engine.step()
    with zerotrain.zero.GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_momentum_of_a_parameter_unused_on_the_first_step_starts_at_zero(stage):
    # Plain PyTorch creates no momentum for a parameter without a gradient; zerotrain's
    # flat state is created for the whole piece and must start at zero for it.
    reference = _sgd_unused_on_first_step(stage, reference=True)
    for out in run_distributed(_sgd_unused_on_first_step, 2, stage, False):
        for name, value in reference.items():
            torch.testing.assert_close(out[name], value, rtol=0, atol=1e-6, msg=name)
