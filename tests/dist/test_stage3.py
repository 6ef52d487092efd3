"""ZeRO stage 3: parity with single-process training, the paper's 3 x params of
communication, memory per rank, models with awkward parameter use, GatheredParameters, and
ranks that take different code paths."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    TINY,
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    micro_batch,
    train_reference,
    train_zerotrain,
    zerotrain_config,
)
from zerotrain.examples.gpt import GPT
from zerotrain.testing.dist import DistributedTestError, run_distributed

# Every unit partitioned: the tiny GPT's blocks are far below DeepSpeed's default threshold.
NO_PERSISTENCE = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4000}


def _spec(**kw) -> RunSpec:
    extra = kw.pop("extra_config", {})
    zero = {**NO_PERSISTENCE, **extra.pop("zero_optimization", {})}
    kw.setdefault("opt_params", PARITY_ADAM)
    return RunSpec(
        two_groups=True,
        freeze="blocks.0.ln1.weight",
        stage=3,
        extra_config={"zero_optimization": zero, **extra},
        **kw,
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage3_matches_single_process_training(world_size):
    """20 steps, accumulation 2, clipping 1.0, tied embedding/head, two param groups, a
    frozen parameter inside a block; shards padded (the counts do not divide by 3 or 4)."""
    spec = _spec()
    results = run_distributed(train_zerotrain, world_size, spec)
    reference = train_reference(spec, world_size)
    for result in results:
        assert_matches(result, reference)


def test_persistent_units_and_prefetch_limits_do_not_change_results():
    # Blocks below the threshold stay gathered; a prefetch budget of one block and a live
    # limit that blocks most prefetching exercise the other paths of the gatherer.
    zero = {
        "stage3_param_persistence_threshold": 20_000,
        "stage3_prefetch_bucket_size": 13_000,
        "stage3_max_live_parameters": 30_000,
    }
    spec = _spec(steps=6, extra_config={"zero_optimization": zero})
    results = run_distributed(train_zerotrain, 2, spec)
    assert_matches(results[1], train_reference(spec, 2))


def test_sgd_and_lamb_match_single_process():
    for optimizer, params in (
        ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
        ("Lamb", {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-6}),  # norms over shards
    ):
        spec = _spec(optimizer=optimizer, opt_params=params, steps=6)
        results = run_distributed(train_zerotrain, 3, spec)
        assert_matches(results[2], train_reference(spec, 3))


# -- communication and memory -----------------------------------------------------------------


def _stage3_step_stats(threshold: int) -> dict:
    spec = RunSpec(steps=3, grad_accum=1, stage=3)
    model = make_model(spec)
    world = dist.get_world_size()
    config = zerotrain_config(spec, world)
    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": threshold}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    batches = global_batches(spec, world)
    snaps = []
    for step in range(spec.steps):
        engine.reset_comm_stats()
        x, y = micro_batch(batches, spec, step, 0, dist.get_rank(), world)
        engine.backward(engine(x, y))
        engine.step()
        snaps.append(engine.comm_stats())
    units = engine.strategy.units
    return {
        "params": [s.get(purpose="parameters").bytes for s in snaps],
        "grads": [s.get(purpose="gradients").bytes for s in snaps],
        "control": [s.get(purpose="control").bytes for s in snaps],
        "padded": sum(4 * u.buffer.layout.padded_numel for u in units),
        "persistent": sum(4 * u.buffer.layout.padded_numel for u in units if u.persistent),
        "memory": engine.memory_breakdown().as_dict(),
        "P": sum(u.numel for u in units),  # the model's parameters are empty between uses
        "unit_bytes": sorted(4 * u.buffer.layout.padded_numel for u in units),
        "labels": [u.label for u in units],
    }


@pytest.mark.parametrize("threshold", [0, 20_000])
def test_communication_per_step_is_three_times_the_parameters(threshold):
    for out in run_distributed(_stage3_step_stats, 3, threshold):
        size, persistent = out["padded"], out["persistent"]
        assert out["labels"] == ["blocks.1", "blocks.0", "<root>"]
        assert (persistent > 0) == (threshold > 0)
        triples = zip(out["params"], out["grads"], out["control"], strict=True)
        for params, grads, control in triples:
            # All-gathers in forward and backward, one reduce-scatter: 3 x params; a
            # persistent unit is gathered once per step (its update) instead of twice.
            assert grads == size
            assert params == 2 * size - persistent
            assert control <= 2 * 8 * 64


def test_memory_breakdown_at_stage3_keeps_one_slice_plus_the_gathered_units():
    for out in run_distributed(_stage3_step_stats, 3, 0):
        mem, p, n = out["memory"], out["P"], 3
        shard = 4 * math.ceil(p / n)
        pad = 4 * n * len(out["unit_bytes"])
        assert shard <= mem["params"] <= shard + pad  # parameters: this rank's slice only
        biggest = out["unit_bytes"]
        # The most gathered at once: the root unit (held through forward and backward)
        # plus the block in use and the one prefetched.
        assert biggest[-1] < mem["gathered"] <= sum(biggest[-3:])
        assert shard <= mem["grads"] <= shard + pad  # the gradient slice
        # The units are small: their reductions share one collective, staged through one
        # buffer holding them side by side (zero/grad_sync.py).
        assert mem["staging"] == sum(biggest)


class _Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Uneven(nn.Module):
    """Units in reduction order: 272 and 4112 elements, then one of 131328 (above the
    batching limit of 131072, and above the persistence threshold), then 8704, 272 and the
    root's 68: reduced as three collectives ([small, small], [large], [small x 3])."""

    def __init__(self) -> None:
        super().__init__()
        widths = [16, 16, 512, 256, 16, 16]
        self.blocks = nn.ModuleList(_Layer(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _uneven_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(steps)
    ]


def _train_uneven(steps: int) -> dict:
    torch.manual_seed(0)
    model = _Uneven()
    config = {
        "train_batch_size": 8,
        "gradient_clipping": 0.05,  # active on every step (gradient norms here are ~0.2-1)
        "optimizer": {"type": "Adam", "params": PARITY_ADAM},
        "zero_optimization": {"stage": 3},  # default persistence: only the large unit is sharded
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    world, rank = dist.get_world_size(), dist.get_rank()
    calls = []
    for x, y in _uneven_batches(steps):
        engine.reset_comm_stats()
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        stats = engine.comm_stats()
        calls.append(
            (
                stats.get("reduce_scatter", "gradients").calls,
                stats.get("all_gather", "parameters").calls,
            )
        )
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = [(u.label, u.persistent) for u in engine.strategy.units]
    return {"params": params, "calls": calls, "units": units}


def test_small_units_are_reduced_and_refreshed_together():
    """Consecutive small units share one reduce-scatter (and persistent ones one refresh
    all-gather after the step), a large unit between them goes alone, and training matches
    plain PyTorch on the whole batch with clipping active."""
    steps = 4
    results = run_distributed(_train_uneven, 2, steps)
    torch.manual_seed(0)
    model = _Uneven()
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)  # DeepSpeed's "Adam" decouples decay
    for x, y in _uneven_batches(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05
        opt.step()
    for result in results:
        assert [p for _, p in result["units"]] == [True, True, False, True, True, True]
        # Reduce-scatters: [blocks.4, blocks.3], [blocks.2], [blocks.1, blocks.0, root].
        # All-gathers: blocks.2 in forward and again in backward, then one refresh of the
        # five persistent units after the step.
        for name, ref in model.named_parameters():
            torch.testing.assert_close(result["params"][name], ref.detach(), rtol=0, atol=1e-6)
        assert result["calls"] == [(3, 3)] * steps


# -- models that use parameters awkwardly -----------------------------------------------------


class Shared(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Awkward(nn.Module):
    """A block called twice, a loose parameter used by the root, a frozen unit parameter."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.layers = nn.ModuleList(Shared(width) for _ in range(3))
        self.scale = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.layers[2].fc.bias.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = self.layers[0](x)
        x = self.layers[1](x)
        x = self.layers[1](x)  # reused
        x = self.layers[2](x) * self.scale
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _train_awkward(stage: int) -> dict:
    torch.manual_seed(0)
    model = Awkward()
    world, rank = dist.get_world_size(), dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, 50, (6, 2, world * 2, 9), generator=gen)
    losses, evals = [], []
    for step in range(6):
        for micro in range(2):
            batch = data[step, micro, rank * 2 : rank * 2 + 2]
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
        engine.eval()
        with torch.no_grad():
            evals.append(engine(data[0, 0, :2, :-1], data[0, 0, :2, 1:]).item())
        engine.train()
        losses.append(engine.comm.all_reduce_floats([evals[-1]])[0] / world)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "evals": evals, "params": params}


def test_reused_module_tied_and_loose_parameters_and_eval_match_stage0():
    stage0 = run_distributed(_train_awkward, 2, 0)
    stage3 = run_distributed(_train_awkward, 2, 3)
    for a, b in zip(stage0, stage3, strict=True):
        assert max(abs(x - y) for x, y in zip(a["evals"], b["evals"], strict=True)) < 1e-5
        for name, value in a["params"].items():
            torch.testing.assert_close(b["params"][name], value, rtol=0, atol=1e-5, msg=name)


class CheckpointedGPT(GPT):
    """The tiny GPT with every block under activation checkpointing (recomputed in backward)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_checkpointed(stage: int) -> list[float]:
    torch.manual_seed(0)
    model = CheckpointedGPT(TINY)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    spec = RunSpec(steps=3, micro_batch=2, grad_accum=2)
    batches = global_batches(spec, 2)
    losses = []
    for step in range(spec.steps):
        for micro in range(2):
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), 2)
            losses.append(engine.backward(engine(x, y)).item())
            engine.step()
    return losses


def test_activation_checkpointing_under_stage3_matches_stage0():
    # Recomputing a block inside backward runs its forward hooks again; the unit must stay
    # gathered for the backward that follows instead of being freed by them.
    stage0 = run_distributed(_train_checkpointed, 2, 0)
    stage3 = run_distributed(_train_checkpointed, 2, 3)
    for a, b in zip(stage0, stage3, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


# -- GatheredParameters -----------------------------------------------------------------------


def _tiny_stage3_engine(steps: int) -> tuple[RunSpec, nn.Module, zerotrain.Engine]:
    spec = RunSpec(steps=steps, grad_accum=1, stage=3)
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    config["zero_optimization"] = NO_PERSISTENCE
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return spec, model, engine


def _modify_on_rank_one() -> dict:
    spec, model, engine = _tiny_stage3_engine(steps=2)
    weight = model.blocks[1].mlp.fc.weight
    released_shape = tuple(weight.shape)
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=1), torch.no_grad():
        whole_shape = tuple(weight.shape)
        if dist.get_rank() == 1:
            weight.fill_(0.5)
        else:
            weight.fill_(-1.0)  # not the modifier: dropped
    with zerotrain.zero.GatheredParameters(model.blocks[1].parameters()):
        seen = weight.detach().clone()
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    # Inside the block one rank may run the model alone (no collectives, nothing freed).
    with zerotrain.zero.GatheredParameters(model.parameters()), torch.no_grad():
        if dist.get_rank() == 0:
            model(x)
            model(x)
    # Training still runs on the changed weights, identically on every rank.
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    with zerotrain.zero.GatheredParameters(weight):
        after = weight.detach().clone()
    return {"released": released_shape, "whole": whole_shape, "seen": seen, "after": after}


def test_gathered_parameters_gives_whole_values_and_keeps_the_modifier_ranks_changes():
    a, b = run_distributed(_modify_on_rank_one, 2)
    assert a["released"] == (0,)
    assert a["whole"] == (128, 32)
    for out in (a, b):
        assert torch.equal(out["seen"], torch.full((128, 32), 0.5))
    torch.testing.assert_close(a["after"], b["after"], rtol=0, atol=0)
    assert not torch.equal(a["after"], a["seen"])  # and the optimizer updated them


# -- ranks that take different code paths -----------------------------------------------------


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_a_rank_skipping_a_block_fails_on_every_rank_naming_the_unit(shared_memory):
    # Shared memory compares every collective's signature; over plain gloo a tiny signature
    # check precedes each collective. Either way the first gather that differs fails at once
    # on every rank, naming the unit.
    env = {"ZEROTRAIN_SHM": shared_memory}
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_skip_gather_on_rank_one, 2, env=env, timeout=60, comm_timeout=8)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank} of 2 raised" in message  # both raised; neither hung or crashed
    assert "entered different collectives" in message
    assert "all_gather of parameters [blocks.0]" in message
    seconds = [float(t) for t in re.findall(r"failed after (\d+\.\d) s", message)]
    assert len(seconds) == 2
    assert max(seconds) < 30


def _skip_gather_on_rank_one() -> None:
    spec, model, engine = _tiny_stage3_engine(steps=1)
    blocks = model.blocks
    if dist.get_rank() == 1:
        # A model whose forward skips a block on one rank (e.g. a data-dependent branch).
        def forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1])
            x = model.wte(idx) + model.wpe(pos)
            x = blocks[1](x)  # blocks[0] skipped
            logits = model.lm_head(model.ln_f(x))
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        model.forward = forward  # type: ignore[method-assign]
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    start = time.monotonic()
    try:
        engine.backward(engine(x, y))
        engine.step()
    except Exception as err:
        raise RuntimeError(f"failed after {time.monotonic() - start:.1f} s: {err}") from None
    raise AssertionError("a rank that skipped a block trained on")


def _blocks_in_another_order_on_rank_one() -> None:
    spec, model, engine = _tiny_stage3_engine(steps=1)
    if dist.get_rank() == 1:
        model.blocks = nn.ModuleList([model.blocks[1], model.blocks[0]])
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    engine.backward(engine(x, y))
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        before = [p.detach().clone() for p in model.parameters()]
    engine.step()
    with zerotrain.zero.GatheredParameters(list(model.parameters())):
        after = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "step applied"
    # The step's verdict stayed on the device (the optimizer skipped it there): a query
    # reads it without raising, and the next step's update raises.
    assert not engine.was_step_applied()
    engine.backward(engine(x, y))
    engine.step()


def test_gathers_that_match_in_size_but_not_in_unit_are_caught_at_the_step():
    # With every per-collective check off, the blocks' gathers pair up (same sizes) and
    # silently exchange the wrong parameters; the fingerprint compared at the accumulation
    # boundary still stops the step on every rank before the optimizer applies anything
    # (on the device, in the optimizer's kernel), and reading the step's verdict raises.
    env = {"ZEROTRAIN_SHM": "0", "ZEROTRAIN_VERIFY_COLLECTIVES": "0"}
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_blocks_in_another_order_on_rank_one, 2, env=env, timeout=60)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank} of 2 raised" in message
    assert message.count("DivergedRanksError") >= 2
    assert "in a different order" in message


# -- review regressions: routing, frozen blocks, pinned training, containers, aux outputs ----


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor


class Routed(nn.Module):
    """Two experts; ``both`` is switched per rank (MoE-style routing), so one rank leaves an
    expert's parameters without a gradient while the other uses them."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.both = True

    def forward(self, x: torch.Tensor) -> BlockOut:  # a dataclass output, traversed too
        return BlockOut(torch.tanh(self.a(x) + self.b(x) if self.both else self.a(x)))


class RoutedNet(nn.Module):
    def __init__(self, width: int = 8, frozen_bias: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Routed(width) for _ in range(4))
        self.out = nn.Linear(width, 1)
        if frozen_bias:  # a frozen parameter in every block (as in partial fine-tuning)
            for block in self.blocks:
                block.a.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h).hidden
        return F.mse_loss(self.out(h).squeeze(-1), y)


def _train_routed(stage: int, route_on_rank1: bool, frozen: bool, pinned: bool) -> dict:
    torch.manual_seed(0)
    model = RoutedNet(frozen_bias=frozen)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        # A prefetch window of one block, so units are gathered and freed one by one.
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 100,
        },
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    if route_on_rank1 and dist.get_rank() == 1:
        for block in model.blocks:
            block.both = False
    gen = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(3, 4, 4, generator=gen), torch.randn(3, 4, generator=gen)
    rank = dist.get_rank()
    held = zerotrain.zero.GatheredParameters(model.blocks[0].parameters()) if pinned else None
    if held is not None:
        held.__enter__()
    losses = []
    for step in range(3):
        loss = engine(xs[step, 2 * rank : 2 * rank + 2], ys[step, 2 * rank : 2 * rank + 2])
        losses.append(engine.backward(loss).item())
        engine.step()
    if held is not None:
        held.__exit__(None, None, None)
    gathered = engine.strategy.gathered_bytes()[1]  # before everything is gathered below
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "gathered_peak": gathered}


@pytest.mark.parametrize(
    ("route", "frozen", "pinned"),
    [(True, False, False), (False, True, False), (False, False, True)],
    ids=["expert-unused-on-one-rank", "frozen-bias-per-block", "training-inside-gathered"],
)
def test_stage3_edge_cases_match_stage0(route, frozen, pinned):
    stage0 = run_distributed(_train_routed, 2, 0, route, frozen, pinned, comm_timeout=20)
    stage3 = run_distributed(_train_routed, 2, 3, route, frozen, pinned, comm_timeout=20)
    for a, b in zip(stage0, stage3, strict=True):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) < 1e-6
        for name, value in a["params"].items():
            torch.testing.assert_close(b["params"][name], value, rtol=0, atol=1e-6, msg=name)
    if frozen:
        # Blocks with a frozen parameter are freed when their backward ends, not at the end
        # of the pass: at most the root, the block in use and one prefetched are gathered.
        block = 4 * (2 * (8 * 8 + 8))
        assert stage3[0]["gathered_peak"] <= 3 * block + 4 * (4 * 8 + 8 + 8 + 1) + 64


class AuxBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.fc(x))
        # A router loss on the block's output: it reaches the loss outside the returned
        # tensor, and its backward runs before the gradient of that tensor is complete.
        self.aux = self.gate(out).pow(2).mean()
        return out


class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AuxBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean() + sum(b.aux for b in self.blocks)


def _aux_loss_outside_outputs() -> None:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    engine, *_ = zerotrain.initialize(model=AuxNet(), config=config)
    engine.backward(engine(torch.randn(2, 8)))


def test_a_loss_that_bypasses_a_units_outputs_gets_an_explanation():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_aux_loss_outside_outputs, 2, comm_timeout=20)
    assert str(info.value).count("without passing through the module's returned outputs") == 2


class LateUse(nn.Module):
    """``layers.1.weight`` also scales ``layers[1]``'s own input: that use's gradient is
    computed after ``layers[1]``'s backward, so it arrives after the unit was reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # two units
        self.late_use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if self.late_use:
            x = x * self.layers[1].weight.mean()
        return self.layers[1](x).pow(2).mean()


def _late_gradients() -> list[str]:
    # Persistent units: the weight stays gathered, so the model can read it outside; each
    # unit reduced alone (batched, layers[1] would wait for layers[0] and take it in time).
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10**6, "reduce_bucket_size": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    model = LateUse()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    errors = []
    for announce_unused in (False, False, True):
        if announce_unused:  # wrongly: its unit is reduced at once, before its gradients
            model.late_use = False
            engine.strategy.expect_no_gradient(list(model.layers[0].parameters()))
        try:
            engine.backward(engine(torch.randn(2, 8)))
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_a_gradient_arriving_after_its_unit_was_reduced_is_an_error_naming_it():
    # Stage 3 takes a unit's gradients once its module's backward is over, with no hook per
    # parameter: without the check at the end of backward, the weight would be stepped
    # without the late part of its gradient. The window is discarded, so the next
    # backward fails the same way (not with a unit left half-reduced).
    for errors in run_distributed(_late_gradients, 2, comm_timeout=20):
        assert len(errors) == 3, errors
        late = "gradient of 'layers.{}.weight' arrived after its unit was already reduced"
        assert late.format(1) in errors[0], errors
        assert late.format(1) in errors[1], errors
        assert late.format(0) in errors[2], errors


class CheckpointedLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        return x.pow(2).mean()


def _gathered_during_reentrant_backward() -> tuple[int, int]:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    engine, *_ = zerotrain.initialize(model=CheckpointedLayers(), config=config)
    gatherer = engine.strategy.gatherer
    x = torch.randn(2, 64, requires_grad=True)
    loss = engine(x)
    gatherer.peak_bytes = gatherer.live_bytes
    engine.backward(loss)
    return gatherer.peak_bytes, gatherer._storage[0].full_nbytes


def test_reentrant_checkpointing_frees_each_recomputed_unit_after_its_backward():
    # The first forward runs without gradients (no signal); the recomputed call's own
    # signal frees the unit. Without it every unit stayed gathered to the end of backward.
    peak, unit_bytes = run_distributed(_gathered_during_reentrant_backward, 2)[0]
    assert peak <= 2 * unit_bytes, (peak, unit_bytes)
