"""``engine.offload_states()`` / ``reload_states()`` run as DeepSpeed's docs and tests use them
(an RLHF loop frees the trained model's states while another model generates), 2 ranks.

DeepSpeed's own test trains a step, records the states, offloads, checks the memory went
and the states are in host memory, reloads and checks every state is back bit for bit. Here
the same at stages 0-3 (fp32 and bf16, whose fp32 master is ``hp_params``), several times in
a run, also in the middle of an accumulation window: the run must then end bit-identical to
one that never offloaded, and both within 1e-5 of one process training the global batch.
On the CPU the tensors stay CPU tensors; what is checked is that their storage was emptied
(the bytes are in the host copy) and refilled. The CUDA case checks device memory.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import (
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    micro_batch,
    train_reference,
    zerotrain_config,
)
from zerotrain.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from zerotrain.testing.dist import run_distributed

STEPS = 4
GAS = 2


def _spec(stage: int, bf16: bool) -> RunSpec:
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    return RunSpec(
        steps=STEPS, micro_batch=2, grad_accum=GAS, clip=0.05, stage=stage, extra_config=extra
    )


def _states(engine: zerotrain.Engine) -> dict[str, list[torch.Tensor]]:
    states = engine.strategy.offloadable_states()
    optimizer = [
        v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return {**states, "optim_states": optimizer}


def _snapshot(engine: zerotrain.Engine) -> dict[str, list[torch.Tensor]]:
    return {
        name: [t.detach().clone() for t in tensors if t.untyped_storage().nbytes()]
        for name, tensors in _states(engine).items()
    }


def _check_offloaded(engine, model, include, expected_params) -> list[str]:
    """What is wrong with the offloaded engine (an empty list: nothing)."""
    problems = []
    for name, tensors in _states(engine).items():
        # Storage torch marks unresizable (host memory a CPU tensor shares with NumPy, as
        # the 1-bit exchange does) stays where it is: it is host memory already.
        kept = [
            t for t in tensors if t.untyped_storage().nbytes() and t.untyped_storage().resizable()
        ]
        if name in include and kept:
            shapes = [tuple(t.shape) for t in kept]
            problems.append(f"{name}: {len(kept)} tensors still hold device storage: {shapes}")
    if "lp_params" in include:
        for pname, p in model.named_parameters():
            if p.numel() and not torch.equal(p.detach(), expected_params[pname]):
                problems.append(f"parameter {pname} does not read its value while offloaded")
    if "lp_grads" in include and any(p.grad is not None for p in model.parameters()):
        problems.append(".grad not None while lp_grads are offloaded")
    x = torch.zeros(1, 4, dtype=torch.long)
    refused = {"engine.step()": engine.step}
    if "lp_params" in include:
        refused["engine(...)"] = lambda: engine(x, x)
        refused["the model's forward"] = lambda: model(x, x)
    for call, fn in refused.items():
        try:
            fn()
            problems.append(f"{call} ran while offloaded")
        except RuntimeError as exc:
            if "reload_states()" not in str(exc):
                problems.append(f"{call}: unclear error {exc}")
    return problems


# Each step's include set, and the micro-step after which it offloads (GAS: after step()).
SCHEDULE = [
    (None, GAS),  # everything, after the step
    ([OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params], GAS),
    (["lp_params", "lp_grads", "contiguous_grad_buffer"], 1),  # mid-window: grads held
    ([OffloadStateTypeEnum.lp_grads], 1),
]


def _train(spec: RunSpec, offload: bool) -> dict:
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    losses, problems = [], []
    for step in range(spec.steps):
        total = 0.0
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            total += engine.backward(engine(x, y)).item()
            engine.step()
            include, after = SCHEDULE[step % len(SCHEDULE)]
            if offload and micro + 1 == after:
                names = {s.value for s in OffloadStateTypeEnum} if include is None else include
                names = {getattr(n, "value", n) for n in names}
                before = _snapshot(engine)
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
                engine.offload_states(include=include, device=OffloadDeviceEnum.cpu)
                found = _check_offloaded(engine, model, names, params)
                problems += [f"step {step}: {p}" for p in found]
                engine.reload_states()
                after_reload = _snapshot(engine)
                for name, tensors in before.items():
                    if len(tensors) != len(after_reload[name]) or not all(
                        torch.equal(a, b) for a, b in zip(tensors, after_reload[name], strict=True)
                    ):
                        problems.append(f"step {step}: {name} changed across offload/reload")
        losses.append(engine.comm.all_reduce_floats([total])[0] / (world * spec.grad_accum))
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "problems": problems}


def _offloading_equals_not_offloading(spec: RunSpec) -> list[dict]:
    """Train ``spec`` with and without the offload schedule; both runs must be identical
    bit for bit on every rank, with nothing wrong found while offloaded."""
    plain = run_distributed(_train, 2, spec, False)
    moved = run_distributed(_train, 2, spec, True)
    for rank in range(2):
        assert moved[rank]["problems"] == []
        assert moved[rank]["losses"] == plain[rank]["losses"]
        for name, value in plain[rank]["params"].items():
            assert torch.equal(moved[rank]["params"][name], value), name
    return moved


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_and_reload_leave_training_bit_identical(stage, bf16):
    spec = _spec(stage, bf16)
    moved = _offloading_equals_not_offloading(spec)
    if not bf16:
        assert_matches(moved[0], train_reference(spec, 2))


@pytest.mark.parametrize("stage", [0, 1])
def test_offload_with_a_compressed_optimizer_stays_bit_identical(stage):
    # OneBitAdam keeps its momentum and error feedback beside optimizer.state (each piece's
    # exp_avg is a view of the momentum); offload_states names them (state_tensors()).
    # On the CPU the 1-bit exchange reads them through NumPy, which makes torch pin them in
    # place, so they stay (host memory already) while exp_avg_sq and the rest move: what
    # this checks is that the run stays bit-identical. On a GPU they move like the rest.
    spec = RunSpec(
        steps=6,
        micro_batch=2,
        grad_accum=GAS,
        clip=0.05,
        stage=stage,
        optimizer="OneBitAdam",
        opt_params={"lr": 1e-3, "freeze_step": 2},
        extra_config={"zero_optimization": {"stage": stage, "reduce_bucket_size": 10**9}},
    )
    _offloading_equals_not_offloading(spec)


def _refusals(tmp: str) -> dict:
    spec = _spec(2, bf16=False)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    for _ in range(GAS):
        engine.backward(engine(x, y))
        engine.step()
    seen: dict[str, str] = {}

    def error(fn) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "no error"

    seen["unknown_state"] = error(lambda: engine.offload_states(include=["moments"]))
    seen["nvme"] = error(lambda: engine.offload_states(device="nvme"))
    seen["unknown_device"] = error(lambda: engine.offload_states(device="gpu"))
    engine.offload_states(device=OffloadDeviceEnum.none)  # a warning, nothing moved
    seen["none_moved"] = str(sorted(engine._states.offloaded))
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    # Generation with the optimizer away: the forward needs only the parameters.
    with torch.no_grad():
        seen["forward_without_optimizer_states"] = str(engine(x, y).isfinite().item())
    seen["backward_then_step"] = error(lambda: (engine.backward(engine(x, y)), engine.step()))
    seen["optimizer_step"] = error(engine.optimizer.step)
    seen["save_checkpoint"] = error(lambda: engine.save_checkpoint(tmp))
    engine.reload_states()
    engine.offload_states(include=[OffloadStateTypeEnum.lp_grads])
    seen["zero_grad"] = error(engine.zero_grad)
    seen["torch_style_backward"] = error(lambda: engine(x, y).backward())
    engine.reload_states()
    engine.reload_states()  # nothing away: nothing to do
    engine.step()  # the pending micro-step's step now runs
    engine.backward(engine(x, y))
    engine.step()  # the window's last: an optimizer step
    seen["global_steps"] = str(engine.global_steps)
    engine.destroy()

    no_optimizer, *_ = zerotrain.initialize(
        model=make_model(spec),
        config={k: v for k, v in zerotrain_config(spec, 2).items() if k != "optimizer"},
    )
    seen["no_optimizer"] = error(no_optimizer.offload_states)
    no_optimizer.destroy()
    offloaded_config = zerotrain_config(spec, 2)
    offloaded_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    offloaded, *_ = zerotrain.initialize(model=make_model(spec), config=offloaded_config)
    seen["with_offload_optimizer"] = error(offloaded.offload_states)
    offloaded.destroy()
    return seen


def test_offload_states_refuses_what_deepspeed_refuses_and_guards_the_training_loop(tmp_path):
    seen = run_distributed(_refusals, 2, str(tmp_path))[0]
    assert "unknown state 'moments'" in seen["unknown_state"]
    assert "optim_states" in seen["unknown_state"]  # the allowed names are listed
    assert "'nvme') is not supported" in seen["nvme"]
    assert "unknown device 'gpu'" in seen["unknown_device"]
    assert seen["none_moved"] == "[]"
    assert seen["forward_without_optimizer_states"] == "True"
    for call in ("backward_then_step", "optimizer_step", "save_checkpoint"):
        assert "needs ['optim_states'], which engine.offload_states()" in seen[call], call
        assert "call engine.reload_states() first" in seen[call], call
    for call in ("zero_grad", "torch_style_backward"):
        assert "needs ['lp_grads']" in seen[call], call
    assert seen["global_steps"] == "2"
    assert not any(tmp_path.iterdir())  # the refused save wrote nothing
    assert "needs an optimizer" in seen["no_optimizer"]
    assert "offload_optimizer" in seen["with_offload_optimizer"]


class _RootScaled(torch.nn.Module):
    """The tiny GPT under a root module with a parameter of its own (stage 3 gathers the
    root's unit in the root's forward pre-hook)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y) * self.scale


def _stage3_guards() -> dict:
    spec = _spec(3, bf16=False)
    model = _RootScaled(make_model(spec))
    config = zerotrain_config(spec, 2)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # all gathered
    engine, *_ = zerotrain.initialize(model=model, config=config)
    params = list(model.parameters())
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    for _ in range(GAS):
        engine.backward(engine(x, y))
        engine.step()
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params])
    seen = {}
    for name, fn in (
        ("model_forward", lambda: model(x, y)),
        ("gathered", lambda: zerotrain.zero.GatheredParameters(params).__enter__()),
    ):
        try:
            fn()
            seen[name] = "no error"
        except RuntimeError as exc:
            seen[name] = str(exc)
    engine.reload_states()
    engine.backward(engine(x, y))  # all back: training goes on
    engine.step()
    engine.destroy()
    return seen


def test_stage_3_gathers_are_refused_while_the_shards_are_away():
    seen = run_distributed(_stage3_guards, 2)[0]
    assert "the model's forward needs ['lp_params']" in seen["model_forward"]
    assert "a stage-3 gather needs ['lp_params']" in seen["gathered"]


def _on_cuda(stage: int) -> dict:
    spec = _spec(stage, bf16=True)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 1))
    x, y = micro_batch(global_batches(spec, 1), spec, 0, 0, 0, 1)
    for _ in range(GAS):
        engine.backward(engine(x.cuda(), y.cuda()))
        engine.step()
    snapshot = _snapshot(engine)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for ts in _states(engine).values()
        for t in ts
        if t.is_cuda
    }
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.offload_states(pin_memory=True, non_blocking=True)
    torch.cuda.synchronize()
    during = torch.cuda.memory_allocated()
    on_host = all(p.device.type == "cpu" for p in model.parameters() if p.numel())
    engine.reload_states(non_blocking=True)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    same = all(
        torch.equal(a, b)
        for name, tensors in _snapshot(engine).items()
        for a, b in zip(snapshot[name], tensors, strict=True)
    )
    engine.backward(engine(x.cuda(), y.cuda()))
    engine.step()
    engine.destroy()
    states = sum(n for ptr, n in storages.items() if ptr)
    return {
        "states": states,
        "before": before,
        "during": during,
        "after": after,
        "same": same,
        "host": on_host,
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [0, 3])
def test_offload_states_frees_device_memory_on_a_gpu(stage, caplog):
    caplog.set_level(logging.INFO)
    seen = run_distributed(_on_cuda, 1, stage, env={"ZEROTRAIN_DEVICE": "cuda"})[0]
    # Every state's device bytes are freed (the staging buffers too, beyond these) and
    # come back; the CUDA context and the communicator's buffers stay.
    assert seen["states"] > 0, seen
    assert seen["before"] - seen["during"] >= seen["states"], seen
    assert seen["after"] - seen["during"] >= seen["states"], seen
    assert seen["same"], seen
    assert seen["host"], seen
