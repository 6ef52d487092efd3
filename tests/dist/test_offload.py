"""ZeRO-Offload / ZeRO-Infinity: optimizer states, fp32 master weights and stage-3
parameter shards on CPU or in swap files give the same training as keeping them resident,
files are removed on exit, and a bad nvme_path fails up front on every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import (
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    run_training,
    train_steps,
    zerotrain_config,
)
from zerotrain.examples.gpt import GPTConfig
from zerotrain.testing.dist import run_distributed

# The demo's GPT shape at test size (2048 tokens per step).
DEMO_GPT = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, bias=False)


def _offload(optimizer: str, param: str, path: str, **extra) -> dict:
    section = {
        "offload_optimizer": {"device": optimizer, "nvme_path": path, "buffer_count": 3},
        "offload_param": {"device": param, "nvme_path": path, "max_in_cpu": 0},
    }
    return {**section, **extra}


def _spec(
    stage: int, offload: dict | None, steps: int = 6, bf16: bool = False, **top: dict
) -> RunSpec:
    zero = {"stage": stage, "reduce_bucket_size": 4000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    extra: dict = {"zero_optimization": {**zero, **(offload or {})}, "wall_clock_breakdown": True}
    if bf16:
        extra["bf16"] = {"enabled": True}
    extra.update(top)
    return RunSpec(
        model=DEMO_GPT,
        micro_batch=4,
        steps=steps,
        stage=stage,
        opt_params={"lr": 1e-3, "weight_decay": 0.01},
        extra_config=extra,
    )


def _train(spec: RunSpec, chunk_numel: int | None = None) -> dict:
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    engine, *_ = zerotrain.initialize(model=model, config=config)
    if chunk_numel is not None and engine.strategy.offload is not None:
        # Small chunks: every piece spans several, so reads ahead and writes behind overlap.
        engine.strategy.offload.optimizer.chunk_numel = chunk_numel  # type: ignore[union-attr]
    result = run_training(engine, spec, model)
    breakdown = engine.memory_breakdown()
    offload = engine.strategy.offload
    swap_dirs = [str(d.path) for d in offload._dirs.values()] if offload is not None else []
    engine.destroy()
    return {
        **result,
        "skipped": engine.skipped_steps,
        "nvme": breakdown.nvme,
        "breakdown": breakdown.as_dict(),
        "swap_dirs": swap_dirs,
        "offload_io": engine.telemetry.wall_clock.seconds["offload_io"],
        "left": [d for d in swap_dirs if os.path.exists(d)],
    }


def _same_training(base: dict, other: dict) -> None:
    assert other["losses"] == pytest.approx(base["losses"], abs=1e-5, rel=0)
    for name, value in base["params"].items():
        torch.testing.assert_close(other["params"][name], value, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_trains_exactly_like_resident_states(stage, tmp_path):
    """offload_optimizer cpu and nvme (and at stage 3 offload_param nvme) on the demo GPT,
    2 ranks, accumulation 2, clipping: losses and final weights equal the run without
    offload (the chunked CPU Adam is bitwise the resident kernel: measured 0 difference)."""
    path = str(tmp_path)
    base = run_distributed(_train, 2, _spec(stage, None))[0]
    variants = {"cpu": _offload("cpu", "none", path), "nvme": _offload("nvme", "none", path)}
    if stage == 3:
        variants["nvme+param"] = _offload("nvme", "nvme", path)
        variants["cpu+param"] = _offload("cpu", "nvme", path)
    for name, section in variants.items():
        result = run_distributed(_train, 2, _spec(stage, section), chunk_numel=4096)[0]
        _same_training(base, result)
        assert result["losses"] == base["losses"], name  # bitwise, in fact
        if "nvme" in name or "param" in name:
            assert result["nvme"] > 0, name
            assert result["offload_io"] > 0, name  # disk waits shown in the breakdown
            assert result["swap_dirs"], name
            assert not result["left"], name
        if name.startswith("nvme"):
            # Gradient slices live in the swap file between reductions.
            assert result["breakdown"]["grads"] == 0, name
            assert base["breakdown"]["grads"] > 0
    assert not list(Path(path).iterdir())  # every swap file removed


def test_bf16_master_weights_swap_to_nvme(tmp_path):
    """bf16 at stage 3: the fp32 master and the moments in files, parameter shards too; the
    same losses as keeping them in memory, and the master no longer counts as resident."""
    base = run_distributed(_train, 2, _spec(3, None, bf16=True))[0]
    section = _offload("nvme", "nvme", str(tmp_path))
    result = run_distributed(_train, 2, _spec(3, section, bf16=True), chunk_numel=3072)[0]
    assert result["losses"] == base["losses"]
    assert base["breakdown"]["master_weights"] > 0
    assert result["breakdown"]["master_weights"] == 0
    assert result["breakdown"]["optimizer_states"] < base["breakdown"]["optimizer_states"] / 100
    # Moments (8 B) and master (4 B) of the owned elements, bf16 shards (2 B), aligned.
    owned = base["breakdown"]["master_weights"] // 4
    assert result["nvme"] >= 14 * owned


def _bad_path(path: str) -> str:
    spec = _spec(2, _offload("nvme", "none", path))
    try:
        zerotrain.initialize(model=make_model(spec), config=zerotrain_config(spec, 2))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_missing_nvme_path_fails_on_every_rank(tmp_path):
    missing = str(tmp_path / "not-there")
    errors = run_distributed(_bad_path, 2, missing, timeout=60)
    for error in errors:
        assert "SwapError" in error, error
        assert "not-there" in error, error
        assert "offload_optimizer.nvme_path" in error


def _resume(spec: RunSpec, save_dir: str) -> dict:
    """Train 3 steps, save, train 3 more; a fresh engine loads the checkpoint and trains
    the same 3 steps."""
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    engine, *_ = zerotrain.initialize(model=model, config=config)
    train_steps(engine, spec, 0, 3)
    engine.save_checkpoint(save_dir, tag="t3")
    after = train_steps(engine, spec, 3, 6)
    engine.destroy()
    model = make_model(RunSpec(model=spec.model))  # other initial weights, overwritten
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.load_checkpoint(save_dir, tag="t3")
    resumed = train_steps(engine, spec, 3, 6)
    engine.destroy()
    return {"after": after, "resumed": resumed}


@pytest.mark.parametrize("bf16", [False, True])
def test_checkpoint_round_trip_with_nvme_offload(tmp_path, bf16):
    """Save reads the swapped states back, load writes them into the new run's files: the
    resumed run repeats the original exactly."""
    swap = tmp_path / "swap"
    swap.mkdir()
    spec = _spec(3, _offload("nvme", "nvme", str(swap)), bf16=bf16)
    result = run_distributed(_resume, 2, spec, str(tmp_path / "ckpt"))[0]
    assert result["resumed"] == result["after"]


def _train_with_clamp(spec: RunSpec) -> list[float]:
    """Two steps, then every parameter clamped in place outside the optimizer, two more."""
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    losses = train_steps(engine, spec, 0, 2)
    with torch.no_grad():
        for param in model.parameters():
            param.clamp_(-0.02, 0.02)
    losses += train_steps(engine, spec, 2, 4)
    engine.destroy()
    return losses


def test_changes_outside_the_optimizer_reach_a_swapped_master(tmp_path):
    """bf16 stage 2: the fp32 master lives in a file, the visible bf16 parameters are
    clamped between steps; the offloaded step takes the clamp into the master exactly as
    the resident step does (without that, publishing would undo the clamp)."""
    base = run_distributed(_train_with_clamp, 2, _spec(2, None, bf16=True))[0]
    section = _offload("nvme", "none", str(tmp_path))
    offloaded = run_distributed(_train_with_clamp, 2, _spec(2, section, bf16=True))[0]
    assert offloaded == base
    unclamped = run_distributed(_train, 2, _spec(2, None, steps=4, bf16=True))[0]["losses"]
    assert unclamped[2:] != base[2:]  # the clamp changed training


@pytest.mark.parametrize(
    "top",
    [
        # Loss scaling from 2**16 overflows in the first steps: the skips and the unscaling
        # of streamed gradients must match the resident run.
        {"fp16": {"enabled": True, "initial_scale_power": 16}},
        # bf16 gradient slices are swapped in bf16 and widened chunk by chunk in the step.
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
    ],
    ids=["fp16-loss-scale", "bf16-accum"],
)
def test_swapped_gradient_slices_train_like_resident_ones(top, tmp_path):
    """Stage 2, accumulation 2, clipping: with the gradient slices in the swap file (norm
    taken as each is written, scale applied as the step reads it) the losses, skipped
    steps and weights equal the resident run's."""
    base = run_distributed(_train, 2, _spec(2, None, steps=8, **top))[0]
    section = _offload("nvme", "none", str(tmp_path))
    result = run_distributed(_train, 2, _spec(2, section, steps=8, **top), chunk_numel=4096)[0]
    assert result["losses"] == base["losses"]
    assert result["skipped"] == base["skipped"]
    if "fp16" in top:
        assert base["skipped"] > 0  # the overflow path ran
    _same_training(base, result)
    assert result["breakdown"]["grads"] == 0


def _train_calling_zero_grad(spec: RunSpec, leading: bool, after: bool = True) -> dict:
    """``leading``: engine.zero_grad() before every step's first backward (a plain-PyTorch
    habit). ``after``: step 1 calls it after its last backward too, so that step sees zero
    gradients."""
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    losses = []
    for step in range(spec.steps):
        if leading:
            engine.zero_grad()
        for micro in range(spec.grad_accum):
            loss = engine.backward(engine(*micro_batch(batches, spec, step, micro, rank, world)))
            if after and step == 1 and micro == spec.grad_accum - 1:
                engine.zero_grad()
            engine.step()
        losses.append(float(loss))
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    offload = engine.strategy.offload
    written = offload.io.bytes_written if offload is not None and offload.io else 0
    engine.destroy()
    return {"losses": losses, "params": params, "written": written}


def test_zero_grad_with_swapped_gradient_slices(tmp_path):
    """zero_grad() before a window's reductions writes nothing to the swap file (the next
    reduction overwrites the slice anyway); after the window's last reduction it zeroes
    what the step reads, as the resident run does."""
    spec = _spec(3, None, steps=4)
    base = run_distributed(_train_calling_zero_grad, 2, spec, True)[0]
    swapped_spec = _spec(3, _offload("nvme", "nvme", str(tmp_path)), steps=4)
    swapped = run_distributed(_train_calling_zero_grad, 2, swapped_spec, True)[0]
    _same_training(base, swapped)
    assert swapped["losses"] == base["losses"]
    without_leading = run_distributed(_train_calling_zero_grad, 2, swapped_spec, False)[0]
    assert without_leading["losses"] == swapped["losses"]
    assert without_leading["written"] == swapped["written"] > 0
    # The zeroed step did change training: plain training differs from step 2 on.
    plain = run_distributed(_train_calling_zero_grad, 2, spec, True, False)[0]["losses"]
    assert plain[:2] == base["losses"][:2]
    assert plain[2:] != base["losses"][2:]


def _destroy_without_restoring(spec: RunSpec) -> dict:
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    train_steps(engine, spec, 0, 2)
    dirs = [d.path for d in engine.strategy.offload._dirs.values()]
    engine.destroy(restore_params=False)
    return {
        "left": [str(d) for d in dirs if d.exists()],
        "held": sum(p.untyped_storage().nbytes() for p in model.parameters()),
    }


def test_destroy_without_restoring_frees_everything(tmp_path):
    """A model that fits only offloaded is not gathered whole on every rank at the end:
    destroy(restore_params=False) detaches, removes the swap files and leaves the
    parameters empty."""
    spec = _spec(3, _offload("nvme", "nvme", str(tmp_path)))
    for result in run_distributed(_destroy_without_restoring, 2, spec):
        assert result == {"left": [], "held": 0}


def _train_with_client_optimizer(spec: RunSpec, kind: str) -> dict:
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    del config["optimizer"]
    lr, wd = spec.opt_params["lr"], spec.opt_params["weight_decay"]
    if kind == "AdamW":
        client = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    elif kind == "Adam":
        client = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
    else:
        client = torch.optim.SGD(model.parameters(), lr=lr)
    try:
        engine, *_ = zerotrain.initialize(model=model, config=config, optimizer=client)
    except ValueError as error:
        return {"error": str(error)}
    result = run_training(engine, spec, model)
    engine.destroy()
    return result


def test_client_adam_under_offload_runs_the_offloaded_step(tmp_path):
    # DeepSpeed-Chat passes torch's (or DeepSpeedCPUAdam's) Adam together with an offload
    # config: its hyper-parameters drive the offloaded step, exactly like the same config
    # section would.
    offload = _offload("cpu", "none", str(tmp_path))
    config_run = _spec(
        2,
        offload,
        steps=3,
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    )
    base = run_distributed(_train, 2, config_run)[0]
    spec = _spec(2, offload, steps=3)
    client = run_distributed(_train_with_client_optimizer, 2, spec, "AdamW")[0]
    assert client["losses"] == base["losses"]
    l2 = run_distributed(_train_with_client_optimizer, 2, spec, "Adam")[0]
    assert l2["losses"][0] == base["losses"][0]
    assert l2["losses"][-1] != base["losses"][-1]  # torch Adam's weight decay is L2, not AdamW's
    (refused, _) = run_distributed(_train_with_client_optimizer, 2, spec, "SGD")
    assert "must be a torch.optim.Adam or AdamW" in refused["error"]


def _train_on_cuda(spec: RunSpec) -> list[float]:
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 1))
    batches = global_batches(spec, 1).to(engine.device)
    losses = []
    for step in range(spec.steps):
        x, y = micro_batch(batches, spec, step, 0, 0, 1)
        losses.append(engine.backward(engine(x, y)).item())
        engine.step()
    engine.destroy()
    return losses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_optimizer_cpu_on_a_gpu_trains_like_resident_states(stage, tmp_path):
    """On an accelerator the host master's gradient stays on the device (torch allows no
    ``.grad`` on another device): the offloaded step copies it chunk by chunk. bf16, one
    GPU; the host Adam and the device's fused Adam agree to rounding."""
    cuda = {"ZEROTRAIN_DEVICE": "cuda"}
    base = run_distributed(_train_on_cuda, 1, _spec(stage, None, bf16=True), env=cuda)[0]
    section = _offload("cpu", "none", str(tmp_path))
    offloaded = run_distributed(_train_on_cuda, 1, _spec(stage, section, bf16=True), env=cuda)
    assert offloaded[0] == pytest.approx(base, abs=1e-3, rel=0)
