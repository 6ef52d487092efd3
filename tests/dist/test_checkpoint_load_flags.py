"""load_checkpoint's DeepSpeed flags, called as DeepSpeed documents them (positionally in
its order: load_dir, tag, load_module_strict, load_optimizer_states,
load_lr_scheduler_states, load_module_only), on 2 ranks at stage 2 with bf16 master
weights and a warm-up schedule:

* load_optimizer_states=False: weights, schedule and counters loaded; the optimizer's states
  stay as they were;
* load_lr_scheduler_states=False: everything but the schedule, which keeps its state;
* load_module_only=True: only the weights;
* load_module_strict=False: a model with a parameter the checkpoint lacks loads the rest;
* custom_load_fn: refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, global_batches, make_model, micro_batch
from tests.helpers.training import zerotrain_config as base_config
from zerotrain.testing.dist import run_distributed

SPEC = RunSpec(steps=3, grad_accum=1, stage=2, extra_config={"bf16": {"enabled": True}})


def _config() -> dict[str, Any]:
    config = base_config(SPEC, 2)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    return config


def _engine(model: torch.nn.Module | None = None):
    engine, optimizer, _, scheduler = zerotrain.initialize(
        model=model if model is not None else make_model(SPEC), config=_config()
    )
    return engine, optimizer, scheduler


def _train(engine, steps: int) -> None:
    batches = global_batches(SPEC, 2)
    for step in range(steps):
        x, y = micro_batch(batches, SPEC, step, 0, dist.get_rank(), 2)
        engine.backward(engine(x, y))
        engine.step()


def _observe(engine, optimizer, scheduler) -> dict[str, Any]:
    moments = sum(
        float(s["exp_avg"].abs().sum()) for s in optimizer.state.values() if "exp_avg" in s
    )
    with zerotrain.zero.GatheredParameters(engine.module.parameters()):
        weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {
        "steps": engine.global_steps,
        "moments": moments,
        "scheduler_epoch": scheduler.last_batch_iteration,
        "lr": optimizer.param_groups[0]["lr"],
        "weights": weights,
    }


def _save(path: str) -> dict[str, Any]:
    engine, optimizer, scheduler = _engine()
    _train(engine, 3)
    engine.save_checkpoint(path, tag="t")
    seen = _observe(engine, optimizer, scheduler)
    engine.destroy()
    return seen


def _load(path: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    model = make_model(SPEC)
    if kwargs.pop("extra_parameter", False):
        model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    engine, optimizer, scheduler = _engine(model)
    _train(engine, 1)  # a schedule and moments of its own, to see what the load replaces
    own = _observe(engine, optimizer, scheduler)
    try:
        engine.load_checkpoint(path, *args, **kwargs)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    seen = _observe(engine, optimizer, scheduler)
    seen["own"] = own
    report = engine.last_load_report
    seen["missing"] = list(report.missing) if report is not None else None
    engine.destroy()
    return seen


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in b)


def test_load_checkpoint_flags_do_what_deepspeed_documents(tmp_path):
    path = str(tmp_path)
    saved = run_distributed(_save, 2, path)[0]

    everything = run_distributed(_load, 2, path, ("t",), {})[0]
    assert _same_weights(everything["weights"], saved["weights"])
    assert everything["steps"] == 3
    assert everything["moments"] == pytest.approx(saved["moments"], rel=1e-6)
    assert everything["scheduler_epoch"] == saved["scheduler_epoch"]

    # load_dir, tag, load_module_strict, load_optimizer_states=False
    no_optimizer = run_distributed(_load, 2, path, ("t", True, False), {})[0]
    assert _same_weights(no_optimizer["weights"], saved["weights"])
    assert no_optimizer["steps"] == 3
    assert no_optimizer["scheduler_epoch"] == saved["scheduler_epoch"]
    assert no_optimizer["lr"] == saved["lr"]
    # The optimizer's states are left as they were (fresh right after initialize).
    assert no_optimizer["moments"] == pytest.approx(no_optimizer["own"]["moments"], rel=1e-6)
    assert no_optimizer["moments"] != pytest.approx(saved["moments"], rel=1e-3)

    # ..., load_lr_scheduler_states=False
    no_schedule = run_distributed(_load, 2, path, ("t", True, True, False), {})[0]
    assert _same_weights(no_schedule["weights"], saved["weights"])
    assert no_schedule["steps"] == 3
    assert no_schedule["moments"] == pytest.approx(saved["moments"], rel=1e-6)
    assert no_schedule["scheduler_epoch"] == no_schedule["own"]["scheduler_epoch"]
    assert no_schedule["scheduler_epoch"] != saved["scheduler_epoch"]

    # ..., load_module_only=True
    module_only = run_distributed(_load, 2, path, ("t", True, True, True, True), {})[0]
    assert _same_weights(module_only["weights"], saved["weights"])
    assert module_only["steps"] == module_only["own"]["steps"] == 1
    assert module_only["scheduler_epoch"] == module_only["own"]["scheduler_epoch"]
    assert module_only["moments"] == pytest.approx(module_only["own"]["moments"], rel=1e-6)

    # load_module_strict=False: the model's extra parameter is reported, the rest loaded.
    relaxed = run_distributed(_load, 2, path, ("t", False), {"extra_parameter": True})[0]
    assert "error" not in relaxed, relaxed
    assert relaxed["missing"] == ["extra"]
    strict = run_distributed(_load, 2, path, ("t",), {"extra_parameter": True})[0]
    assert "IncompatibleCheckpointError" in strict["error"]

    refused = run_distributed(_load, 2, path, ("t",), {"custom_load_fn": print})[0]
    assert "custom_load_fn=...) is not supported" in refused["error"]
