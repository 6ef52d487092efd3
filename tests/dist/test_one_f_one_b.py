"""ZeRO driven the way a pipeline schedule drives it: 1F1B order, one reduction per step.

A pipeline stage runs the forwards of several micro-batches before the backward of the
first (warm-up), then alternates one forward and one backward, then drains the remaining
backwards. Gradients are accumulated locally (``set_requires_gradient_sync(False)``) until
the last micro-batch's backward, which reduces all of them at once. The test checks that
outstanding forwards do not confuse stage 3's backward bookkeeping (units freed as soon as
each backward is done with them, reductions launched once), that the result equals
single-process accumulation over the same global batch, and that gradients move once per
step, not once per micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import zerotrain
from tests.helpers.training import (
    TINY,
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    train_reference,
)
from zerotrain.testing.dist import run_distributed

MICRO_BATCHES = 4
WARMUP = 2  # forwards of micro-batches 0..2 run before the backward of micro-batch 0
SPEC = RunSpec(
    optimizer="SGD",
    opt_params={"lr": 0.5},
    steps=2,
    micro_batch=2,
    grad_accum=MICRO_BATCHES,  # the data layout: M micro-batches per rank per step
    clip=0.0,
    model=dataclasses.replace(TINY, n_layer=4),  # enough blocks for freeing to show
)


def _order(micro_batches: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B: ``warmup + 1`` forwards, then backward/forward pairs, then the backwards."""
    order = [("F", m) for m in range(warmup + 1)]
    next_forward = warmup + 1
    for m in range(micro_batches):
        order.append(("B", m))
        if next_forward < micro_batches:
            order.append(("F", next_forward))
            next_forward += 1
    return order


def test_the_schedule_has_outstanding_forwards():
    order = _order(MICRO_BATCHES, WARMUP)
    assert order[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert sorted(order) == sorted([("F", m) for m in range(4)] + [("B", m) for m in range(4)])


def _train_one_f_one_b(stage: int, reshard_after_backward: bool) -> dict:
    model = make_model(SPEC)
    world = torch.distributed.get_world_size()
    config = {
        "train_batch_size": SPEC.micro_batch * world,
        "optimizer": {"type": "SGD", "params": dict(SPEC.opt_params)},
        # Units this small would all stay gathered (persistent) by default.
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 4000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 15_000,  # about one block ahead
        },
        "steps_per_print": 1000,
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    strategy = engine.strategy
    strategy.set_reshard_after_backward(reshard_after_backward)
    batches = global_batches(SPEC, world)
    losses, live_after_backward = [], []
    engine.reset_comm_stats()
    if strategy.gatherer is not None:
        strategy.gatherer.peak_bytes = strategy.gatherer.live_bytes
    for step in range(SPEC.steps):
        outstanding: dict[int, torch.Tensor] = {}
        total = 0.0
        for kind, m in _order(MICRO_BATCHES, WARMUP):
            if kind == "F":
                x, y = micro_batch(batches, SPEC, step, m, engine.dp_rank, world)
                outstanding[m] = engine(x, y) / MICRO_BATCHES
                continue
            last = m == MICRO_BATCHES - 1
            # Every backward but the last accumulates locally; the last reduces them all.
            with contextlib.nullcontext() if last else engine.no_sync():
                total += engine.backward(outstanding.pop(m)).item()
            if strategy.gatherer is not None:
                live_after_backward.append(strategy.gatherer.live_bytes)
        engine.step()
        losses.append(engine.comm.all_reduce_floats([total])[0] / world)
    stats = engine.comm_stats()
    peak = strategy.gatherer.peak_bytes if strategy.gatherer else 0
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    persistent = sum(u.buffer.full_nbytes for u in strategy.units if u.persistent)
    return {
        "losses": losses,
        "params": params,
        "grad_calls": stats.get(op="reduce_scatter", purpose="gradients").calls,
        "grad_payload": stats.get(op="reduce_scatter", purpose="gradients").payload_bytes,
        "param_gathers": stats.get(op="all_gather", purpose="parameters").calls,
        "padded_bytes": sum(u.buffer.layout.padded_numel * 4 for u in strategy.units),
        "units": len(strategy.units),
        "live_after_backward": live_after_backward,
        "persistent_bytes": persistent,
        "peak_gathered": peak,
        "model_bytes": sum(u.buffer.layout.padded_numel * 4 for u in strategy.units),
        "outstanding": strategy.gatherer.outstanding_passes if strategy.gatherer else 0,
    }


@pytest.mark.parametrize(
    ("stage", "reshard"), [(2, True), (3, True), (3, False)], ids=["stage2", "stage3", "held"]
)
def test_one_f_one_b_equals_single_process_accumulation_with_one_reduction(stage, reshard):
    results = run_distributed(_train_one_f_one_b, 2, stage, reshard, timeout=240)
    reference = train_reference(SPEC, 2)
    for got in results:
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-6
        )
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-6)
        # One reduce-scatter of every unit per step, not one per micro-batch.
        assert got["grad_calls"] == got["units"] * SPEC.steps, got
        assert got["grad_payload"] == got["padded_bytes"] * SPEC.steps, got
        assert got["outstanding"] == 0
        if stage == 3 and reshard:
            # Every backward released what it gathered, with later forwards outstanding.
            assert set(got["live_after_backward"]) == {got["persistent_bytes"]}, got
            # ... and freed each unit as soon as one backward was done with it, although
            # later forwards were outstanding (not at the end of backward: whole model).
            assert got["peak_gathered"] <= 0.6 * got["model_bytes"], got


def test_holding_units_across_backward_saves_gathers():
    released = run_distributed(_train_one_f_one_b, 2, 3, True, timeout=240)[0]
    held = run_distributed(_train_one_f_one_b, 2, 3, False, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(held["losses"]), torch.tensor(released["losses"]))
    # Held: each unit is gathered for the forwards and the first backward that uses it,
    # then kept; released: gathered again for every micro-batch's backward.
    assert held["param_gathers"] < released["param_gathers"], (held, released)
    assert max(held["live_after_backward"]) > held["persistent_bytes"]


def _passes_after_forwards_without_backward() -> tuple[int, int, int]:
    model = make_model(SPEC)
    config = {
        "train_batch_size": SPEC.micro_batch,
        "optimizer": {"type": "SGD", "params": dict(SPEC.opt_params)},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    x, y = micro_batch(global_batches(SPEC, 1), SPEC, 0, 0, 0, 1)
    gatherer = engine.strategy.gatherer
    for _ in range(5):
        engine(x, y)  # gradients on, never backpropagated: the graph is dropped at once
    dropped = gatherer.outstanding_passes
    kept = [engine(x, y) for _ in range(3)]  # graphs alive: their passes wait
    alive = gatherer.outstanding_passes
    engine.backward(sum(kept))  # one backward reaches all three
    return dropped, alive, gatherer.outstanding_passes


def test_forwards_no_backward_reaches_do_not_pile_up():
    assert run_distributed(_passes_after_forwards_without_backward, 1, timeout=120)[0] == (
        0,
        3,
        0,
    )
