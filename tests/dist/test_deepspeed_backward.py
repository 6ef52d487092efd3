"""DeepSpeed's ways of calling backward, run as its docs show them, on 2 ranks against one
process training the whole global batch with plain PyTorch (1e-5):

* several ``engine.backward()`` calls before ``step()`` add up (each micro-batch split in
  two halves, one backward per half), clipping active;
* ``backward(loss, scale_wrt_gas=False)`` leaves the division by the accumulation steps to
  the caller (here: the caller divides, so training equals the default);
* ``set_gradient_accumulation_boundary(False)`` for the first micro-batches and ``True``
  for the last, with one ``step()`` per window (DeepSpeed's documented pattern);
* torch-style ``loss.backward()`` then ``engine.step()``.
"""

from __future__ import annotations

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
from zerotrain.testing.dist import run_distributed

STEPS = 4


def _spec(stage: int, bf16: bool = False, sgd: bool = False) -> RunSpec:
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    if sgd:
        # Plain SGD without clipping: a gradient off by a constant factor shows (Adam and
        # clipping would hide it).
        return RunSpec(
            optimizer="SGD",
            opt_params={"lr": 0.5},
            steps=STEPS,
            micro_batch=4,
            grad_accum=3,
            clip=0.0,
            stage=stage,
            extra_config=extra,
        )
    # micro-batch 4 (two halves of 2), accumulation 3, clipping that acts.
    return RunSpec(
        steps=STEPS, micro_batch=4, grad_accum=3, clip=0.05, stage=stage, extra_config=extra
    )


class _DictOutputs(torch.nn.Module):
    """The demo GPT returning what a transformers model returns: the loss and the logits
    and hidden states it was computed from (parameter names as the GPT's)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        g = self.gpt
        h = g.drop(g.wte(x) + g.wpe(torch.arange(x.shape[1])))
        for block in g.blocks:
            h = block(h)
        logits = g.lm_head(g.ln_f(h))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        return {"loss": loss, "logits": logits, "hidden_states": h}


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _train(spec: RunSpec, style: str) -> dict:
    gpt = make_model(spec)
    model = _DictOutputs(gpt) if style == "torch_outputs" else gpt
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(spec, world)
    gas = spec.grad_accum
    losses, boundaries, flags = [], [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(gas):
            x, y = micro_batch(batches, spec, step, micro, rank, world)
            last = micro == gas - 1
            if style == "two_backwards":
                half = x.shape[0] // 2
                for part in (slice(0, half), slice(half, None)):
                    loss = engine(x[part], y[part]) / 2
                    engine.backward(loss)
                    total += loss.item()
                engine.step()
            elif style == "torch":
                loss = engine(x, y)
                loss.backward()  # torch-style: the engine's output hooks run its pass
                total += loss.item()
                engine.step()
            elif style == "torch_outputs":
                # A transformers-style output: the loss and the tensors it came from; the
                # gradient is divided once, at the loss (not again at the logits).
                out = engine(x, y)
                out["loss"].backward()
                total += out["loss"].item()
                engine.step()
            elif style == "default":
                loss = engine(x, y)
                engine.backward(loss)
                total += loss.item()
                engine.step()
            elif style == "scale_wrt_gas":
                loss = engine(x, y)
                engine.backward(loss / gas, scale_wrt_gas=False)
                total += loss.item()
                engine.step()
            elif style == "boundary":
                engine.set_gradient_accumulation_boundary(last)
                flags.append(engine.is_gradient_accumulation_boundary())
                loss = engine(x, y)
                engine.backward(loss)
                total += loss.item()
                if last:
                    engine.step()
            else:
                raise ValueError(style)
        losses.append(_global_mean(total / gas))
        boundaries.append(engine.global_steps)
    with zerotrain.zero.GatheredParameters(gpt.parameters()):
        params = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "global_steps": boundaries, "flags": flags}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backward_styles_of_deepspeed_scripts_train_like_one_process(stage):
    spec = _spec(stage)
    reference = train_reference(spec, 2)
    for style in ("two_backwards", "boundary", "torch", "torch_outputs"):
        result = run_distributed(_train, 2, spec, style)[0]
        assert_matches(result, reference)
        assert result["global_steps"] == list(range(1, STEPS + 1)), style
        if style == "boundary":
            assert result["flags"] == [False, False, True] * STEPS
    sgd = _spec(stage, sgd=True)
    result = run_distributed(_train, 2, sgd, "scale_wrt_gas")[0]
    assert_matches(result, train_reference(sgd, 2))


def test_scale_wrt_gas_false_under_bf16_undoes_the_division_in_the_reduction():
    # Mixed precision divides by the accumulation steps in the fp32 reduction, not in the
    # loss: scale_wrt_gas=False must undo that one, or the gradient would be divided twice
    # (SGD: the updates would be a third as large).
    spec = _spec(2, bf16=True, sgd=True)
    default = run_distributed(_train, 2, spec, "default")[0]
    caller_divides = run_distributed(_train, 2, spec, "scale_wrt_gas")[0]
    assert caller_divides["losses"] == pytest.approx(default["losses"], abs=1e-6, rel=0)
    for name, value in default["params"].items():
        torch.testing.assert_close(caller_divides["params"][name], value, atol=1e-6, rtol=0)


def _queries() -> dict:
    spec = RunSpec(steps=1, grad_accum=1, extra_config={"bf16": {"enabled": True}})
    config = zerotrain_config(spec, 2)
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_num_steps": 4, "warmup_type": "linear"},
    }
    engine, optimizer, _, _ = zerotrain.initialize(model=make_model(spec), config=config)
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    seen = {
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "config_is_what_was_passed": engine.config == config,
        "overflow_before": optimizer.overflow,
        "group_lr_before_step": [],
        "last_step_lr_after_step": [],
        "group_lr_after_step": [],
        "get_lr_after_step": [],
        "get_mom": engine.get_mom(),
    }
    for _ in range(4):
        seen["group_lr_before_step"].append(optimizer.param_groups[0]["lr"])
        engine.backward(engine(x, y))
        engine.step()
        seen["last_step_lr_after_step"].append(engine.get_lr_of_last_step()[0])
        seen["group_lr_after_step"].append(optimizer.param_groups[0]["lr"])
        seen["get_lr_after_step"].append(engine.get_lr()[0])
    seen["overflow_after_finite"] = optimizer.overflow
    engine.backward(engine(x, y) * float("inf"))  # inf/NaN gradients: the step is skipped
    engine.step()
    seen["overflow_after_inf"] = optimizer.overflow
    seen["applied"] = engine.was_step_applied()
    engine.destroy()
    return seen


def test_engine_queries_of_deepspeed_scripts():
    seen = run_distributed(_queries, 2)[0]
    assert seen["bf16"] is True
    assert seen["fp16"] is False
    assert seen["config_is_what_was_passed"]
    assert seen["overflow_before"] is False
    assert seen["overflow_after_finite"] is False
    assert seen["overflow_after_inf"] is True
    assert seen["applied"] is False
    # get_lr_of_last_step after a step is the rate that step used (the group held it
    # before the step), while the warm-up changes it; get_lr is DeepSpeed's: the group's
    # rate now, which the scheduler has already moved on.
    assert seen["last_step_lr_after_step"] == seen["group_lr_before_step"]
    assert seen["get_lr_after_step"] == seen["group_lr_after_step"]
    assert seen["get_lr_after_step"] != seen["group_lr_before_step"]
    assert len(set(seen["group_lr_before_step"])) > 2
    assert [tuple(b) for b in seen["get_mom"]] == [(0.9, 0.999)]  # Adam: its betas
