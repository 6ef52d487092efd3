"""Mixed precision: bf16 tracks fp32 training, the fp32 master is what the optimizer
updates, fp16 overflows skip the step on every rank and move the loss scale, and memory
per rank follows the ZeRO paper's mixed-precision Adam accounting."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from tests.helpers.pairwise import pairwise
from tests.helpers.training import (
    DEMO_GPT,
    DEMO_RUN,
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    run_training,
    train_reference,
    train_zerotrain,
    zero_section,
    zerotrain_config,
)
from zerotrain.comm.collectives import Communicator
from zerotrain.config.errors import ConfigError
from zerotrain.testing.dist import run_distributed

STAGES = [0, 1, 2, 3]


def _linear_engine(
    stage: int,
    width: int,
    lr: float,
    buffer: bool = False,
    precision: str = "bf16",
    zero: dict | None = None,
) -> tuple[nn.Linear, zerotrain.Engine]:
    """A bias-free linear layer with every weight 1.0 (and an fp32 buffer of 1/3 if
    ``buffer``), trained in ``precision`` by SGD at ``lr``."""
    model = nn.Linear(width, width, bias=False)
    nn.init.ones_(model.weight)
    if buffer:
        model.register_buffer("scale", torch.full((2,), 1 / 3))
    config = {
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "zero_optimization": {**zero_section(stage), **(zero or {})},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return model, engine


def _bf16_run(spec: RunSpec) -> dict:
    result = train_zerotrain(spec)
    engine_dtypes = {p.dtype for p in result["params"].values()}
    return {**result, "dtypes": sorted(map(str, engine_dtypes))}


CURVE_STEPS = 20  # the long horizon (300 steps, a picture) is benchmarks/bf16_curves.py


@functools.cache
def _fp32_curve() -> dict:
    """fp32 training of the same global batches in this process, once for every stage."""
    return train_reference(RunSpec(steps=CURVE_STEPS, **DEMO_RUN), 2)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_follows_the_fp32_loss_curve(stage):
    """The demo GPT on 2 ranks, accumulation 2, clipping: within 2% of fp32 training of
    the same global batches at every 5th step (measured: within 0.61%, and the stages'
    losses equal; over 300 steps the same 0.61%, benchmarks/bf16_curves.py)."""
    bf16 = RunSpec(
        stage=stage,
        steps=CURVE_STEPS,
        extra_config={"bf16": {"enabled": True}, "zero_optimization": zero_section(stage)},
        **DEMO_RUN,
    )
    results = run_distributed(_bf16_run, 2, bf16)
    ref = _fp32_curve()["losses"]
    for result in results:
        assert result["dtypes"] == ["torch.bfloat16"]  # parameters live in bf16
        got = result["losses"]
        for step in [*range(0, CURVE_STEPS, 5), CURVE_STEPS - 1]:
            rel = abs(got[step] - ref[step]) / ref[step]
            assert rel < 0.02, f"step {step}: bf16 {got[step]:.4f} vs fp32 {ref[step]:.4f}"
    assert ref[-1] < ref[0] - 1.0  # it trained


def _tiny_updates(stage: int) -> dict:
    """SGD steps of 5e-4 on weights at 1.0: each step is below half of bf16's spacing
    there (2**-9), so only an fp32 master can accumulate them."""
    model, engine = _linear_engine(stage, 8, lr=5e-4)
    optimizer = engine.optimizer
    x = torch.ones(1, 8)  # d(sum of outputs) / d(weight) = 1 for every element

    def step() -> None:
        engine.backward(engine(x).sum())
        engine.step()

    def weights() -> torch.Tensor:
        with zerotrain.zero.GatheredParameters([model.weight]):
            return model.weight.detach().clone()

    def master() -> list[float]:
        return [v for g in optimizer.param_groups for p in g["params"] for v in p.tolist()]

    for _ in range(3):
        step()
    after3 = (weights(), master())
    for _ in range(5):
        step()
    return {
        "dtype": str(model.weight.dtype),
        "after3": after3,
        "after8": (weights(), master()),
        "master_dtypes": {str(p.dtype) for g in optimizer.param_groups for p in g["params"]},
    }


@pytest.mark.parametrize("stage", STAGES)
def test_updates_below_bf16_resolution_accumulate_in_the_fp32_master(stage):
    for out in run_distributed(_tiny_updates, 2, stage):
        assert out["dtype"] == "torch.bfloat16"
        assert out["master_dtypes"] == {"torch.float32"}
        weights3, master3 = out["after3"]
        # Three updates later the bf16 weights have not moved (1 - 1.5e-3 rounds to 1) ...
        assert torch.equal(weights3, torch.ones(8, 8, dtype=torch.bfloat16))
        # ... but the master holds every one of them (padding of a shard stays 0).
        real = [v for v in master3 if v != 0.0]
        assert real
        assert all(abs(v - (1 - 3 * 5e-4)) < 1e-6 for v in real)
        weights8, master8 = out["after8"]
        real = [v for v in master8 if v != 0.0]
        assert all(abs(v - (1 - 8 * 5e-4)) < 1e-6 for v in real)
        # The weights are now the master rounded to bf16 (0.99609375); updates applied to
        # bf16 weights directly would never have left 1.0.
        expected = torch.full((8, 8), 1 - 8 * 5e-4).to(torch.bfloat16)
        assert torch.equal(weights8, expected)


# -- fp16: overflow and loss scaling ---------------------------------------------------------


# DeepSpeed's cadence: the scale doubles at a clean step that follows a positive multiple of
# the window of clean steps since the last overflow (the 3rd step after one, with window 2).
FP16 = {
    "enabled": True,
    "initial_scale_power": 8,
    "loss_scale_window": 2,
    "hysteresis": 1,
    "min_loss_scale": 1,
}


def _overflow(stage: int) -> dict:
    """Steps 1-2 clean, step 3 gets an inf gradient on rank 1 only, steps 4-6 clean."""
    spec = RunSpec(
        stage=stage,
        steps=6,
        extra_config={"fp16": FP16, "zero_optimization": zero_section(stage)},
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(spec)
    engine, optimizer, _, _ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, world)
    )
    inject = {"now": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if not inject["now"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    model.blocks[1].mlp.fc.weight.register_hook(poison)

    def snapshot() -> dict:
        with zerotrain.zero.GatheredParameters(model.parameters()):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        moments = [s["exp_avg"].clone() for s in optimizer.state.values() if "exp_avg" in s]
        # The fp32 master slices the optimizer steps (a skipped step must not touch them
        # either: the next step would round them into the parameters).
        master = [p.clone() for g in optimizer.param_groups for p in g["params"]]
        return {"params": params, "moments": moments + master}

    batches = global_batches(spec, world)
    record = []
    for step in range(spec.steps):
        before = snapshot() if step == 2 else None
        for micro in range(spec.grad_accum):
            inject["now"] = step == 2 and rank == 1 and micro == 1
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            engine.backward(engine(x, y))
            engine.step()
        entry = {
            "scale": engine.loss_scale,
            "skipped": engine.skipped_steps,
            "applied": engine.was_step_applied(),
        }
        if before is not None:
            after = snapshot()
            entry["params_unchanged"] = all(
                torch.equal(before["params"][n], after["params"][n]) for n in before["params"]
            )
            entry["moments_unchanged"] = len(before["moments"]) == len(after["moments"]) and all(
                torch.equal(a, b) for a, b in zip(before["moments"], after["moments"], strict=True)
            )
        record.append(entry)
    return {"record": record, "dtype": str(next(model.parameters()).dtype)}


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    for out in run_distributed(_overflow, 2, stage):
        record = out["record"]
        assert out["dtype"] == "torch.float16"
        assert [r["scale"] for r in record] == [256, 256, 128, 128, 128, 256]
        assert [r["skipped"] for r in record] == [0, 0, 1, 1, 1, 1]
        assert [r["applied"] for r in record] == [True, True, False, True, True, True]
        assert record[2]["params_unchanged"]
        assert record[2]["moments_unchanged"]  # Adam's moments and the fp32 master


def _static_scale() -> dict:
    spec = RunSpec(stage=2, steps=3, extra_config={"fp16": {"enabled": True, "loss_scale": 64}})
    result = train_zerotrain(spec)
    return result


def test_fp16_with_a_static_scale_trains_like_fp32():
    spec = RunSpec(stage=2, steps=3)
    reference = train_reference(spec, 2)
    for result in run_distributed(_static_scale, 2):
        for got, ref in zip(result["losses"], reference["losses"], strict=True):
            assert abs(got - ref) / ref < 0.01


# -- memory ----------------------------------------------------------------------------------


def _memory(stage: int, accum: str) -> dict:
    spec = RunSpec(
        stage=stage,
        steps=1,
        grad_accum=1,
        extra_config={
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": accum},
            "zero_optimization": zero_section(stage),
        },
    )
    world = dist.get_world_size()
    model = make_model(spec)
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, world))
    x, y = micro_batch(global_batches(spec, world), spec, 0, 0, dist.get_rank(), world)
    engine.backward(engine(x, y))
    engine.step()
    units = engine.strategy.units
    return {
        **engine.memory_breakdown().as_dict(),
        "numel": numel,
        "units": len(units),
        "pieces": sum(len(u.pieces) for u in units),
    }


# Every pair of (stage, world size, accumulation dtype) once, 8 of the 16 jobs: each factor
# moves one term of the formula (docs/testing.md).
@pytest.mark.parametrize(
    ("stage", "world_size", "accum"), pairwise(STAGES, [2, 4], ["bf16", "fp32"])
)
def test_bf16_memory_per_rank_follows_the_zero_paper(stage, world_size, accum):
    """2 bytes of parameters + G bytes of gradients + 12 bytes of fp32 master and Adam
    moments per parameter, each divided by N where the stage partitions it (the paper keeps
    16-bit gradients, G = 2; zerotrain's default fp32 accumulation has G = 4)."""
    g = 2 if accum == "bf16" else 4
    for out in run_distributed(_memory, world_size, stage, accum):
        psi, n = out["numel"], world_size
        # bytes per parameter, and whether the stage divides that category by N
        categories = {
            "params": (2, stage >= 3),
            "grads": (g, stage >= 2),
            "master_weights": (4, stage >= 1),
            "optimizer_states": (8, stage >= 1),
        }
        expected = {k: b * psi / (n if split else 1) for k, (b, split) in categories.items()}
        padding = 16 * n * out["units"]  # under n padding elements per unit, 16 bytes each
        steps = 4 * out["pieces"]  # Adam's step counter: one fp32 scalar per piece
        for key, value in expected.items():
            extra = steps if key == "optimizer_states" else 0
            assert abs(out[key] - extra - value) <= padding, (key, out[key], value)
        paper = (2 + g + 12) * psi if stage == 0 else None
        if paper is not None:
            total = out["params"] + out["grads"] + out["master_weights"]
            assert abs(total + out["optimizer_states"] - steps - paper) <= padding


# -- configuration and communication ---------------------------------------------------------


def _bf16_comm(comm_dtype: str | None) -> dict:
    extra = {"bf16": {"enabled": True}, "zero_optimization": zero_section(2)}
    if comm_dtype:
        extra["communication_data_type"] = comm_dtype
    spec = RunSpec(stage=2, steps=5, extra_config=extra)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    result = run_training(engine, spec, model)
    result["grad_bytes"] = engine.comm_stats().get(purpose="gradients").payload_bytes
    return result


def test_communication_data_type_halves_gradient_bytes_and_still_trains():
    fp32 = run_distributed(_bf16_comm, 2, None)[0]
    bf16 = run_distributed(_bf16_comm, 2, "bf16")[0]
    assert bf16["grad_bytes"] * 2 == fp32["grad_bytes"]
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert abs(a - b) / a < 0.01


def _reduce_through_fp32() -> dict:
    comm = Communicator(shared_memory=False)
    for dtype in (torch.bfloat16, torch.float16):
        comm._native[("cpu", dtype)] = False  # as on a gloo build without 16-bit sums
    rank, world = dist.get_rank(), dist.get_world_size()
    every = [torch.randn(8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mine = every[rank].to(torch.bfloat16)
    summed = mine.clone()
    comm.all_reduce(summed, purpose="test")
    out = torch.empty(8 // world, dtype=torch.bfloat16)
    comm.reduce_scatter(out, mine.clone(), purpose="test")
    gathered = torch.empty(8 * world, dtype=torch.bfloat16)
    comm.all_gather_into(gathered, mine, purpose="test")
    exact = sum(t.to(torch.bfloat16).float() for t in every)
    return {
        "summed": summed,
        "out": out,
        "gathered": gathered,
        "expected_sum": exact.to(torch.bfloat16),  # the fp32 sum, rounded once
        "expected_gather": torch.cat([t.to(torch.bfloat16) for t in every]),
        "reduced_bytes": comm.snapshot().get(op="all_reduce", purpose="test").payload_bytes,
    }


def test_comm_layer_reduces_16_bit_tensors_in_fp32_where_the_backend_cannot():
    for rank, out in enumerate(run_distributed(_reduce_through_fp32, 2)):
        assert torch.equal(out["summed"], out["expected_sum"])
        assert torch.equal(out["out"], out["expected_sum"][rank * 4 : (rank + 1) * 4])
        assert torch.equal(out["gathered"], out["expected_gather"])  # bits moved unchanged
        assert out["reduced_bytes"] == 8 * 4  # carried as fp32


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
        (
            {"bf16": {"enabled": True}, "communication_data_type": "fp16"},
            "communication_data_type",
        ),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
            "data_types.grad_accum_dtype",
        ),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ],
)
def test_contradictory_precision_settings_are_refused(config, path):
    from zerotrain.config.loader import load_config
    from zerotrain.config.policies import to_policies

    cfg = load_config({"train_batch_size": 2, **config})
    with pytest.raises(ConfigError) as err:
        to_policies(cfg, 1)
    assert path in str(err.value)


def _modify_then_step(stage: int) -> list[float]:
    model, engine = _linear_engine(stage, 4, lr=0.0)
    with zerotrain.zero.GatheredParameters([model.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                model.weight.fill_(2.0)
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()  # lr 0: rounds the master into the weights again
    with zerotrain.zero.GatheredParameters([model.weight]):
        return model.weight.float().flatten().tolist()


@pytest.mark.parametrize("stage", STAGES)
def test_changes_made_in_gathered_parameters_reach_the_master(stage):
    for weights in run_distributed(_modify_then_step, 2, stage):
        assert weights == [2.0] * 16  # not written back to 1.0 by the next step


def _user_optimizer(kind: str) -> list[float]:
    spec = RunSpec(stage=0, steps=4, clip=0.0, extra_config={"bf16": {"enabled": True}})
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    optimizer = None
    if kind == "user":
        del config["optimizer"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = zerotrain.initialize(model=model, optimizer=optimizer, config=config)
    return run_training(engine, spec, model)["losses"]


def test_a_user_optimizer_at_stage_0_steps_the_fp32_master():
    """A torch optimizer passed in holds the bf16 parameters; zerotrain rebuilds it over
    the fp32 master (as it does at stages >= 1), so it trains like the config's AdamW."""
    config = run_distributed(_user_optimizer, 2, "config")[0]
    user = run_distributed(_user_optimizer, 2, "user")[0]
    assert user == config


def _master_from_init() -> dict:
    from zerotrain.comm.env import init_distributed
    from zerotrain.examples.gpt import GPT
    from zerotrain.shard.owned import copy_owned_range

    init_distributed()
    torch.manual_seed(3)
    built = dict(GPT(DEMO_GPT).named_parameters())
    torch.manual_seed(3)
    with zerotrain.zero.Init():
        model = GPT(DEMO_GPT)
    config = {
        "train_batch_size": 2,
        "bf16": {"enabled": True},
        "zero_optimization": zero_section(3),
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    same, rounded = [], []
    for unit in engine.strategy.units:
        layout = unit.buffer.layout

        def value(i: int, layout=layout) -> torch.Tensor:
            return built[layout.params[i].fqn].detach()

        expected = copy_owned_range(layout, unit.owned, value, torch.float32, unit.master.device)
        same.append(torch.equal(unit.master, expected))
        rounded.append(torch.equal(unit.master, unit.master.bfloat16().float()))
    return {"same": same, "rounded": rounded}


def test_zero_init_master_weights_hold_the_fp32_initial_values():
    """A model built by zero.Init and trained in bf16 at stage 3: each rank's master slice
    is the fp32 initialisation itself, not its bf16 rounding."""
    for out in run_distributed(_master_from_init, 2):
        assert out["same"]
        assert all(out["same"])
        assert not any(out["rounded"])


# -- gradient arithmetic with a scale-sensitive optimizer ------------------------------------


def _sgd_run(precision: dict, stage: int) -> dict:
    # SGD (unlike Adam) moves by the gradient itself: a wrong 1/accumulation or 1/world
    # division, or a loss scale left in, changes the weights.
    spec = RunSpec(
        stage=stage,
        steps=4,
        grad_accum=3,
        clip=0.0,
        optimizer="SGD",
        opt_params={"lr": 0.1},
        extra_config={**precision, "zero_optimization": zero_section(stage)},
        **{k: v for k, v in DEMO_RUN.items() if k != "opt_params"},
    )
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    norms = []
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    for step in range(spec.steps):
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            engine.backward(engine(x, y))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    with zerotrain.zero.GatheredParameters(model.parameters()):
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"norms": norms, "weights": weights, "skipped": engine.skipped_steps}


@pytest.mark.parametrize(
    ("precision", "stage"),
    [
        ({"bf16": {"enabled": True}}, 1),
        ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, 0),
        ({"fp16": {"enabled": True, "initial_scale_power": 10}}, 2),
        (
            {
                "fp16": {"enabled": True, "loss_scale": 128},
                "data_types": {"grad_accum_dtype": "fp16"},
            },
            1,
        ),
        ({"fp16": {"enabled": True, "initial_scale_power": 10}}, 3),
    ],
)
def test_gradients_are_averaged_and_unscaled_like_fp32(precision, stage):
    """Accumulation 3 on 2 ranks with SGD: gradient norms within 1% and weights within
    bf16/fp16 resolution of the same training in fp32."""
    fp32 = run_distributed(_sgd_run, 2, {}, stage)[0]
    mixed = run_distributed(_sgd_run, 2, precision, stage)[0]
    assert mixed["skipped"] == 0
    for a, b in zip(mixed["norms"], fp32["norms"], strict=True):
        assert abs(a - b) / b < 0.01, (mixed["norms"], fp32["norms"])
    for name, ref in fp32["weights"].items():
        diff = (mixed["weights"][name] - ref).abs().max().item()
        assert diff < 0.02 * max(ref.abs().max().item(), 1.0), name


# -- overflow in bf16, fp16 communication, frozen parameters, destroy() ---------------------


def _bf16_nan(check: bool, action: str = "skip") -> dict:
    model = nn.Linear(4, 4, bias=False)
    config = {
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": True, "check_grad_overflow": check},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero_section(2),
        "non_finite_gradients": {"action": action},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    poison = model.weight.register_hook(lambda g: g * float("nan"))
    x = torch.ones(1, 4) * (1 if dist.get_rank() == 0 else 2)
    engine.backward(engine(x).sum())
    engine.step()
    poison.remove()
    with zerotrain.zero.GatheredParameters([model.weight]):
        finite = bool(torch.isfinite(model.weight).all())
    return {"finite": finite, "skipped": engine.skipped_steps}


def test_bf16_check_grad_overflow_skips_non_finite_steps():
    assert run_distributed(_bf16_nan, 2, True) == [{"finite": True, "skipped": 1}] * 2
    # Without DeepSpeed's check, zerotrain's own policy (non_finite_gradients) still skips;
    # with its action "ignore" bf16 applies the step, as DeepSpeed does.
    assert run_distributed(_bf16_nan, 2, False) == [{"finite": True, "skipped": 1}] * 2
    ignored = run_distributed(_bf16_nan, 2, False, "ignore")
    assert ignored == [{"finite": False, "skipped": 0}] * 2


def _frozen_master(stage: int) -> dict:
    spec = RunSpec(
        stage=stage,
        steps=1,
        grad_accum=1,
        extra_config={"bf16": {"enabled": True}, "zero_optimization": zero_section(stage)},
    )
    model = make_model(spec)
    for block in model.blocks:
        block.requires_grad_(False)  # only the embeddings and the final norm train
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    return {"master": engine.memory_breakdown().master_weights, "trainable": trainable}


@pytest.mark.parametrize("stage", [0, 3])
def test_frozen_parameters_get_no_master_copy(stage):
    for out in run_distributed(_frozen_master, 2, stage):
        shards = 1 if stage == 0 else 2
        assert out["master"] <= 4 * out["trainable"] / shards + 4 * 2 * 8


def _destroy(stage: int) -> dict:
    model, engine = _linear_engine(stage, 8, lr=5e-4, buffer=True)
    for _ in range(3):
        engine.backward(engine(torch.ones(1, 8)).sum())
        engine.step()
    engine.destroy()
    return {
        "weight": model.weight.detach().clone(),
        "buffer": model.scale.clone(),
    }


@pytest.mark.parametrize("stage", STAGES)
def test_destroy_hands_back_the_fp32_master(stage):
    """After engine.destroy() the model is in its own dtype again, holding the master
    values (three updates of 5e-4 that its bf16 copy never showed)."""
    for out in run_distributed(_destroy, 2, stage):
        assert out["weight"].dtype == torch.float32
        assert torch.allclose(out["weight"], torch.full((8, 8), 1 - 3 * 5e-4), atol=1e-6)
        assert out["buffer"].dtype == torch.float32


def _changed_outside(stage: int, how: str, precision: str) -> dict:
    persistent = {"stage3_param_persistence_threshold": 10**6} if stage == 3 else {}
    model, engine = _linear_engine(stage, 4, lr=0.0, precision=precision, zero=persistent)
    with torch.no_grad():
        if how == "load_state_dict":
            model.load_state_dict({"weight": torch.full((4, 4), 0.5)})  # same on every rank
        elif how == "replace":  # a tensor of its own: the parameter leaves the flat buffer
            model.weight.data = torch.full((4, 4), 0.5, dtype=model.weight.dtype)
        else:
            model.weight.data.fill_(0.5)  # invisible to version counters: told explicitly
            engine.parameters_changed()
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    after_step = model.weight.float().flatten().tolist()
    with torch.no_grad():
        model.weight.fill_(0.25)
    engine.destroy()  # a change since the last step is kept too
    return {"after_step": after_step, "destroyed": model.weight.flatten().tolist()}


@pytest.mark.parametrize("how", ["load_state_dict", "data"])
@pytest.mark.parametrize(
    ("stage", "precision"), [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "fp32")]
)
def test_parameters_changed_outside_the_optimizer_are_kept(stage, precision, how):
    """After initialize, at every stage (stage 3: a unit that stays gathered): the next
    step continues from the new values, and destroy() hands them back."""
    for out in run_distributed(_changed_outside, 2, stage, how, precision):
        assert out["after_step"] == [0.5] * 16  # not overwritten by a stale master/shard
        assert out["destroyed"] == [0.25] * 16


@pytest.mark.parametrize(("stage", "precision"), [(0, "bf16"), (1, "fp32"), (2, "bf16")])
def test_a_parameter_given_new_data_is_taken_back_into_the_buffer(stage, precision):
    """``param.data = t`` between steps (stages 0-2, where parameters live in one flat
    buffer): the next step continues from ``t`` (found by an address check since
    2026-11-28, no longer a view per parameter per step)."""
    for out in run_distributed(_changed_outside, 2, stage, "replace", precision):
        assert out["after_step"] == [0.5] * 16
        assert out["destroyed"] == [0.25] * 16


def _clamped_neighbour(stage: int, precision: str) -> list[float]:
    """A parameter clamped after every step (OpenCLIP's logit scale) shares the unit with
    weights that take updates below bf16's resolution."""
    model = nn.Module()
    model.lin = nn.Linear(8, 8, bias=False)
    model.scale = nn.Parameter(torch.tensor(5.0))
    nn.init.ones_(model.lin.weight)
    model.forward = lambda x: (model.lin(x) * model.scale).sum()  # type: ignore[method-assign]
    config = {
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
        "zero_optimization": zero_section(stage),
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    for _ in range(10):
        engine.backward(engine(torch.ones(1, 8)))
        engine.step()
        with torch.no_grad():
            model.scale.clamp_(0, 4.6)
    engine.destroy()
    return model.lin.weight.flatten().tolist()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_outside_change_to_one_parameter_leaves_the_others_masters_alone(stage):
    fp32 = run_distributed(_clamped_neighbour, 2, stage, "fp32")[0]
    for weights in run_distributed(_clamped_neighbour, 2, stage, "bf16"):
        # The weights moved by ~5e-3 in steps of ~5e-4, each below bf16's resolution at
        # 1.0 (2**-8): only an intact master follows fp32 training this closely (rounding
        # it to bf16 at any step would cost up to 2e-3).
        assert 1 - weights[0] > 4e-3
        assert max(abs(a - b) for a, b in zip(weights, fp32, strict=True)) < 1e-4


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, target.dtype)
        return ((self.lin(x).float() - target) ** 2).mean()


def _inputs(auto_cast: bool) -> dict:
    model = _Regression()
    config = {
        "train_batch_size": dist.get_world_size(),
        "bf16": {"enabled": True, "auto_cast": auto_cast},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    x = torch.ones(1, 4)
    target = torch.tensor([[999.0]])  # 1000 in bf16
    engine.backward(engine(x.bfloat16(), target=target))
    engine.step()
    try:
        engine(x, target=target)
        plain_input = "accepted"
    except RuntimeError as err:
        plain_input = "dtype" if "dtype" in str(err) else str(err)
    return {"seen": [str(d) for d in model.seen], "fp32 input": plain_input}


def test_inputs_are_cast_unless_auto_cast_is_off():
    cast = run_distributed(_inputs, 2, True)[0]
    assert cast == {"seen": ["torch.bfloat16", "torch.bfloat16"], "fp32 input": "accepted"}
    kept = run_distributed(_inputs, 2, False)[0]
    # The float target keeps its exact value; an fp32 input meets bf16 weights and fails.
    assert kept == {"seen": ["torch.float32", "torch.float32"], "fp32 input": "dtype"}


def _already_bf16(stage: int) -> dict:
    spec = RunSpec(
        stage=stage,
        steps=8,
        extra_config={"bf16": {"enabled": True}, "zero_optimization": zero_section(stage)},
    )
    model = make_model(spec).bfloat16()  # handed over in bf16 already
    engine, optimizer, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    result = run_training(engine, spec, model)
    masters = {str(p.dtype) for g in optimizer.param_groups for p in g["params"]}
    return {"losses": result["losses"], "masters": masters}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_already_in_bf16_gets_fp32_masters_and_trains(stage):
    for out in run_distributed(_already_bf16, 2, stage):
        assert out["masters"] == {"torch.float32"}
        assert out["losses"][-1] < out["losses"][0] - 0.5
