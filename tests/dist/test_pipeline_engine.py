"""What a pipeline engine promises besides matching numbers.

* Gradient traffic per step follows the policy exactly: with ``per_microbatch`` every unit
  of a stage is reduce-scattered once per micro-batch (M x the stage's gradient bytes),
  with ``end_of_step`` once (1 x), at ZeRO stages 2 and 3, for 1F1B and interleaved.
* Activations move once per micro-batch each way; the shapes' description only on the first
  micro-batch and again when the input shapes change (a shorter curriculum sequence, a
  smaller last batch), and training goes on correctly after each change.
* Integer and bool tensors cross stages as themselves; gradients flow through the float
  ones, equal to one process's.
* A layer returning something other than tensors is named; impossible schedules are
  refused at initialize with the constraint; ``forward`` is refused on a split model;
  ``eval_batch`` returns the same loss on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import zerotrain
from tests.helpers.pairwise import pairwise
from tests.helpers.pipeline import (
    SPEC,
    PipeRun,
    micro_batches,
    pipeline_module,
)
from zerotrain.examples.gpt import gpt_loss_fn
from zerotrain.pipe import LayerSpec, PipelineModule
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed

MICRO = 8


def _gradient_traffic(run: PipeRun) -> dict:
    module = pipeline_module(run.stages, run.virtual_stages)
    engine, _, _, _ = zerotrain.initialize(model=module, config=run.config(2))
    engine.train_batch(iter(micro_batches(engine, 0, MICRO)))  # descriptions move here
    engine.reset_comm_stats()
    engine.train_batch(iter(micro_batches(engine, 1, MICRO)))
    stats = engine.comm_stats()
    grads = stats.get(op="reduce_scatter", purpose="gradients")
    return {
        "grad_bytes": grads.payload_bytes,
        "grad_calls": grads.calls,
        "stage_grad_bytes": sum(u.buffer.layout.padded_numel * 4 for u in engine.strategy.units),
        "units": len(engine.strategy.units),
        "activations_sent": stats.get(op="send", purpose="activations").calls,
        "activation_grads_sent": stats.get(op="send", purpose="activation_gradients").calls,
        "shapes_sent": stats.get(purpose="stage_shapes").calls,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
    }


# Every pair of (ZeRO stage, schedule, policy) once, 4 of the 8 jobs: the traffic is the
# policy's count times each stage's units, whatever the pair (docs/testing.md).
@pytest.mark.parametrize(
    ("zero_stage", "schedule", "policy"),
    pairwise([2, 3], ["1f1b", "interleaved"], ["per_microbatch", "end_of_step"]),
)
def test_gradient_traffic_per_step_follows_the_policy(zero_stage, schedule, policy):
    virtual = {"1f1b": 1, "interleaved": 2}[schedule]
    run = PipeRun(
        2, schedule, virtual, zero_stage=zero_stage, grad_reduce=policy, micro_batches=MICRO
    )
    times = MICRO if policy == "per_microbatch" else 1
    for rank, got in enumerate(run_distributed(_gradient_traffic, 4, run, timeout=240)):
        assert got["grad_bytes"] == times * got["stage_grad_bytes"], (rank, got)
        assert got["grad_calls"] == times * got["units"], (rank, got)
        # Each stage boundary a rank sends across carries one message per micro-batch.
        boundaries = virtual - (1 if got["last"] else 0)
        assert got["activations_sent"] == MICRO * boundaries, (rank, got)
        backward_boundaries = virtual - (1 if got["first"] else 0)
        assert got["activation_grads_sent"] == MICRO * backward_boundaries, (rank, got)
        assert got["shapes_sent"] == 0, (rank, got)  # same shapes as the first step


def _launched_during_backward(zero_stage: int) -> dict:
    run = PipeRun(2, "interleaved", 2, zero_stage=zero_stage, grad_reduce="per_microbatch",
                  micro_batches=4)  # fmt: skip
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(2, 2), config=run.config(2))
    sync = engine.strategy.sync
    launched: list[tuple[int, int]] = []  # per syncing backward: (launched by then, units)
    remaining = sync.launch_remaining

    def recording() -> None:
        if sync._syncing:
            launched.append((sync._next, len(sync.units)))
        remaining()

    sync.launch_remaining = recording  # this engine's synchronizer only
    engine.train_batch(iter(micro_batches(engine, 0, 4)))
    return {"launched": launched}


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_interleaved_per_microbatch_reductions_start_during_backward(zero_stage):
    """P7 (review 2026-11-28): the syncing backward (the rank's lowest stage) waited on the
    first unit in reduction order, a higher chunk's, which gets no gradient in that pass,
    so no reduction started before the end of backward. Now the other chunk's units are
    launched at once, and this chunk's as its gradients complete. Stage 3 also waited for
    every outstanding forward pass (the other micro-batches in flight) to run backward
    through a unit, where a pipeline's backward reaches one pass; and behind the tied
    embedding, first in unit order, which only the end of backward reports done (its
    input, token ids, needs no gradient): it now launches last."""
    for rank, got in enumerate(run_distributed(_launched_during_backward, 4, zero_stage)):
        # Stages 2-3 reduce once per micro-batch; stage 1 keeps whole gradients, once a step.
        assert len(got["launched"]) == {1: 1, 2: 4, 3: 4}[zero_stage], (rank, got)
        for before_end, units in got["launched"]:
            assert before_end > units // 2, (rank, got)  # was 0 in every pass


def _norm_when_read(action: str) -> dict:
    run = PipeRun(2, "1f1b", zero_stage=1, micro_batches=4)
    config = run.config(1)
    config.update(gradient_clipping=0.0, steps_per_print=3)
    config["non_finite_gradients"] = {"action": action}
    return _train_counting_norms(config)


def _train_counting_norms(config: dict) -> dict:
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(2), config=config)
    computed, norms, losses = [], [], []
    grad_norm = engine.strategy.grad_norm

    def counting():
        computed.append(engine.global_steps + 1)
        return grad_norm()

    engine.strategy.grad_norm = counting  # this engine's strategy only
    for step in range(4):
        losses.append(float(engine.train_batch(iter(micro_batches(engine, step, 4)))))
        norms.append(engine.get_global_grad_norm())
    return {"computed": computed, "norms": norms, "losses": losses}


def test_the_gradient_norm_is_computed_only_when_something_reads_it():
    """No clipping, non-finite gradients ignored, no monitor: the norm (a pass over the
    gradients and, in a pipeline, an all-reduce that makes every stage wait for the
    slowest) is computed only on the steps_per_print steps, and training is unchanged."""
    skipping = run_distributed(_norm_when_read, 2, "ignore")
    checking = run_distributed(_norm_when_read, 2, "skip")
    for lean, full in zip(skipping, checking, strict=True):
        assert lean["computed"] == [3], lean
        assert [n is None for n in lean["norms"]] == [True, True, False, True], lean
        assert full["computed"] == [1, 2, 3, 4], full
        assert lean["losses"] == full["losses"]  # bit-identical
        assert lean["norms"][2] == full["norms"][2]


def _changing_shapes() -> dict:
    run = PipeRun(2, "1f1b", zero_stage=2, micro_batches=4)
    module = pipeline_module(2)
    engine, _, _, _ = zerotrain.initialize(model=module, config=run.config(1))
    shapes_sent, losses = [], []
    for step, (length, rows) in enumerate([(16, 2), (16, 2), (8, 2), (16, 2), (16, 1)]):
        batches = [
            (x[:rows, :length], y[:rows, :length]) for x, y in micro_batches(engine, step, 4)
        ]
        engine.reset_comm_stats()
        losses.append(float(engine.train_batch(iter(batches))))
        shapes_sent.append(engine.comm_stats().get(op="send", purpose="stage_shapes").calls)
    return {"shapes_sent": shapes_sent, "losses": losses, "first": engine.is_first_stage()}


def _changing_shapes_reference() -> list[float]:
    module = pipeline_module(1)
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=SPEC.opt_params["lr"], weight_decay=0.01, eps=1e-6)
    losses = []
    for step, (length, rows) in enumerate([(16, 2), (16, 2), (8, 2), (16, 2), (16, 1)]):
        batches = [(x[:rows, :length], y[:rows, :length]) for x, y in micro_batches(None, step, 4)]
        opt.zero_grad()
        total = sum(gpt_loss_fn(module(x), y) for x, y in batches) / len(batches)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, SPEC.clip)
        opt.step()
        losses.append(total.item())
    return losses


def test_shapes_are_described_when_they_change_and_training_follows():
    results = run_distributed(_changing_shapes, 2, timeout=240)
    first = next(r for r in results if r["first"])
    # Step 0: new shapes; 1: same; 2: shorter sequences; 3: the first shapes again (known);
    # 4: one row per micro-batch.
    assert first["shapes_sent"] == [1, 0, 1, 0, 1]
    reference = _changing_shapes_reference()
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference), rtol=0, atol=1e-5
        )


class _Split(nn.Module):
    """Stage 0: float features, the integer ids and a bool mask, all sent on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor):
        return self.embed(ids), ids * 3, ids % 2 == 0


class _Use(nn.Module):
    """Stage 1: uses all three (the integer and bool ones must arrive as themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 1)

    def forward(self, inputs):
        features, tripled, even = inputs
        assert tripled.dtype == torch.int64
        assert even.dtype == torch.bool
        scale = (tripled.float() / 3 + 1) * even.float()
        return self.proj(features).squeeze(-1) * scale


def _mixed_layers() -> list:
    return [LayerSpec(_Split), LayerSpec(_Use)]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _mixed_dtypes(stages: int) -> dict:
    module = PipelineModule(
        _mixed_layers(),
        num_stages=stages,
        loss_fn=_mse,
        seed_layers=True,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = zerotrain.initialize(model=module, config=config)
    with pytest.raises(NotImplementedError, match=r"compile\(\) on a pipeline is not supported"):
        engine.compile()  # refused, not half-done: the executor is untested compiled
    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(0, 16, (4, 5), generator=gen), torch.randn(4, 5, generator=gen))
        for _ in range(2)
    ]
    losses = [float(engine.train_batch(iter(batches))) for _ in range(3)]
    with zerotrain.zero.GatheredParameters(list(module.parameters())):
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": losses, "params": params}


def test_integer_and_bool_tensors_cross_as_themselves():
    results = run_distributed(_mixed_dtypes, 2, 2, timeout=120)
    reference = run_distributed(_mixed_dtypes, 1, 1, timeout=120)[0]
    params = {**results[0]["params"], **results[1]["params"]}
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-6
        )


class _ReturnsDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        return {"hidden": self.lin(x)}


def _non_tensor_boundary() -> str:
    module = PipelineModule(
        [LayerSpec(nn.Linear, 4, 4), LayerSpec(_ReturnsDict), LayerSpec(nn.Linear, 4, 4)],
        num_stages=2,
        loss_fn=_mse,
        partition_method="uniform",
    )
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, _, _, _ = zerotrain.initialize(model=module, config=config)
    batches = [(torch.randn(1, 4), torch.randn(1, 4)) for _ in range(2)]
    try:
        engine.train_batch(iter(batches))
    except Exception as err:  # stage 0 names the layer; stage 1 loses its peer
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_layer_returning_a_dict_is_named():
    first, second = run_distributed(
        _non_tensor_boundary, 2, timeout=120, comm_timeout=5, own_processes=BREAKS_THE_GROUP
    )
    assert first.startswith("TypeError"), first
    assert "layer 1 (_ReturnsDict)" in first, first
    assert "dict" in first, first
    assert "rank 0" in second, second  # the next stage's receive names the stage it lost


def _refused(schedule: str, virtual: int, micro: int) -> str:
    run = dataclasses.replace(PipeRun(2, schedule, virtual), micro_batches=micro)
    try:
        zerotrain.initialize(model=pipeline_module(2, virtual), config=run.config(1))
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize(
    ("schedule", "virtual", "micro", "says"),
    [
        ("1f1b", 1, 1, "at least as many micro-batches"),
        ("interleaved", 2, 3, "multiple"),
        ("zb-h1", 1, 4, "runs full backwards only"),
    ],
)
def test_impossible_schedules_are_refused_with_the_constraint(schedule, virtual, micro, says):
    for message in run_distributed(_refused, 2, schedule, virtual, micro, timeout=120):
        assert says in message, message


def _eval_and_forward() -> dict:
    run = PipeRun(2, "1f1b", zero_stage=3, micro_batches=4)
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(2), config=run.config(1))
    batches = micro_batches(engine, 0, 4)
    loss = float(engine.eval_batch(iter(batches)))
    # Fewer micro-batches than training uses (1F1B could not train on 1 < P).
    first = float(engine.eval_batch(iter(batches[:1]), num_micro_batches=1))
    try:
        engine(batches[0][0])
    except RuntimeError as err:
        refused = str(err)
    else:
        refused = ""
    return {"loss": loss, "first": first, "refused": refused}


def test_eval_batch_gives_every_rank_the_loss_and_forward_is_refused():
    results = run_distributed(_eval_and_forward, 2, timeout=120)
    module = pipeline_module(1)
    with torch.no_grad():
        batches = micro_batches(None, 0, 4)
        each = [gpt_loss_fn(module(x), y).item() for x, y in batches]
    for result in results:
        assert result["loss"] == pytest.approx(sum(each) / 4, abs=1e-6)
        assert result["first"] == pytest.approx(each[0], abs=1e-6)
        assert "train_batch" in result["refused"]


def _mixed_precision(precision: dict) -> dict:
    run = PipeRun(2, "1f1b", zero_stage=2, micro_batches=4)
    config = {**run.config(1), **precision}
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(2), config=config)
    losses = []
    for step in range(4):
        engine.reset_comm_stats()
        losses.append(float(engine.train_batch(iter(micro_batches(engine, step, 4)))))
    sent = engine.comm_stats().get(op="send", purpose="activations")
    return {
        "losses": losses,
        "activation_bytes": sent.payload_bytes,
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
        "norm": engine.get_global_grad_norm(),
        "first": engine.is_first_stage(),
    }


def test_bf16_activations_cross_stages_in_bf16_and_train():
    results = run_distributed(_mixed_precision, 2, {"bf16": {"enabled": True}}, timeout=180)
    first = next(r for r in results if r["first"])
    # 4 micro-batches of 2 x 16 positions x 32 features, 2 bytes each.
    assert first["activation_bytes"] == 4 * 2 * 16 * 32 * 2
    reference = train_reference_losses(4)
    for result in results:
        assert result["losses"] == results[0]["losses"]  # the loss reaches every rank
        for got, want in zip(result["losses"], reference, strict=True):
            assert abs(got - want) < 3e-2, (result["losses"], reference)


def test_fp16_overflow_skips_agree_across_stages():
    # A first loss scale of 2**32 overflows fp16: the steps are skipped on every stage alike
    # (the overflow is decided on the norm summed over the stages), and the scale, the
    # schedule and the norm stay the same everywhere.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 32, "loss_scale_window": 2}}
    results = run_distributed(_mixed_precision, 2, fp16, timeout=180)
    assert results[0]["skipped"] > 0
    for key in ("skipped", "scale", "lr", "norm", "losses"):
        assert str(results[0][key]) == str(results[1][key]), key  # nan included


def train_reference_losses(steps: int) -> list[float]:
    from tests.helpers.pipeline import train_reference

    return train_reference(steps=steps)["losses"]


def _config_disagrees_with_module() -> str:
    run = PipeRun(2)
    config = run.config(1)
    config["pipeline"]["seed_layers"] = False  # the module is built with seed_layers=True
    try:
        zerotrain.initialize(model=pipeline_module(2), config=config)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_a_config_key_the_module_was_built_without_is_refused():
    for message in run_distributed(_config_disagrees_with_module, 2, timeout=120):
        assert "pipeline.seed_layers=False" in message, message
        assert "seed_layers=True" in message, message


def _runs_out_of_data() -> str:
    run = PipeRun(3, "1f1b", zero_stage=1, micro_batches=4)
    module = pipeline_module(3)
    engine, _, _, _ = zerotrain.initialize(model=module, config=run.config(1))
    batches = micro_batches(engine, 0, 4)
    engine.train_batch(iter(batches))
    try:
        engine.train_batch(iter(batches[:3]))  # one micro-batch short
    except StopIteration as stop:
        return f"StopIteration: {stop}"
    return "no error"


def test_data_running_out_stops_every_stage_with_stop_iteration():
    # The middle stage reads no data, yet learns of it and stops too (DeepSpeed's users
    # end their loops on StopIteration).
    results = run_distributed(_runs_out_of_data, 3, timeout=120, comm_timeout=20)
    assert "ran out after 3 of the 4" in results[0], results
    assert "ran out on pipeline stage(s) [0, 2]" in results[1], results
    assert "ran out after 3 of the 4" in results[2], results


def _fails_part_way() -> list[str]:
    run = PipeRun(2, "1f1b", zero_stage=2, micro_batches=4)
    module = pipeline_module(2)
    engine, _, _, _ = zerotrain.initialize(model=module, config=run.config(1))
    batches = micro_batches(engine, 0, 4)
    if engine.is_last_stage():
        labels = batches[2][1].clone()
        labels[0, 0] = 10_000  # out of the vocabulary: cross-entropy raises in micro-batch 2
        batches[2] = (batches[2][0], labels)
    seen = []
    for _ in range(2):
        try:
            engine.train_batch(iter(batches))
        except Exception as err:
            seen.append(f"{type(err).__name__}: {err}".splitlines()[0])
    return seen


def test_a_step_that_fails_part_way_refuses_the_next():
    results = run_distributed(
        _fails_part_way, 2, timeout=120, comm_timeout=8, own_processes=BREAKS_THE_GROUP
    )
    for seen in results:
        assert len(seen) == 2, seen
        assert "cannot go on; restart from the last checkpoint" in seen[1], seen
    assert "IndexError" in results[1][0] or "out of bounds" in results[1][0], results


def _parameter_gathers(reshard: bool) -> dict:
    run = PipeRun(2, "1f1b", zero_stage=3, micro_batches=4, reshard_after_forward=reshard)
    engine, _, _, _ = zerotrain.initialize(model=pipeline_module(2), config=run.config(2))
    engine.train_batch(iter(micro_batches(engine, 0, 4)))
    engine.reset_comm_stats()
    engine.train_batch(iter(micro_batches(engine, 1, 4)))
    gathers = engine.comm_stats().get(op="all_gather", purpose="parameters")
    return {"calls": gathers.calls, "units": len(engine.strategy.units)}


@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_reshard_after_forward_decides_how_often_a_stage_is_gathered(reshard):
    for got in run_distributed(_parameter_gathers, 4, reshard, timeout=180):
        if reshard:
            # Every unit before each micro-batch's forward and again for its backward.
            assert got["calls"] == 2 * 4 * got["units"], got
        else:
            assert got["calls"] == got["units"], got  # once for the whole step
