"""Steps whose gradients hold inf/NaN under fp32 and bf16 (issue 29, item 5).

Before, such a step updated the parameters to NaN without a word (fp16 skipped through its
loss scaler). Now, by default (``non_finite_gradients.action: "skip"``), the update is
skipped on every rank, logged with the step and the first non-finite parameter, counted in
``skipped_steps``, and training goes on; ``max_consecutive_skips`` steps in a row raise,
and ``action: "raise"`` raises at once. The fault is real: a gradient hook turns one
parameter's gradient into NaN on one rank only.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.testing.dist import run_distributed

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 6


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARMUP = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 8}}


def _train(
    stage: int,
    dtype: str,
    poison: list[int],
    section: dict[str, Any],
    schedule: bool = False,
    query: bool = False,
) -> dict:
    """Train STEPS steps; at each step in ``poison`` rank 1 turns ``wpe.weight``'s gradient
    into NaN. Returns what happened on this rank."""
    torch.manual_seed(0)
    model = GPT(CFG)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "non_finite_gradients": section,
        "steps_per_print": 1000,
    }
    if schedule:
        config["scheduler"] = WARMUP
    engine, *_ = zerotrain.initialize(model=model, config=config)
    captured = _Captured()
    logging.getLogger("zerotrain").addHandler(captured)
    state = {"step": 0}

    def poisoned(grad: torch.Tensor) -> torch.Tensor:
        hit = state["step"] in poison and dist.get_rank() == 1
        return grad * float("nan") if hit else grad

    model.wpe.weight.register_hook(poisoned)
    tokens = torch.randint(
        0, 256, (STEPS, 2, CFG.block_size + 1), generator=torch.Generator().manual_seed(1)
    )
    snapshots, error, lrs, counted = [], None, [], []
    try:
        for step in range(STEPS):
            state["step"] = step
            engine.backward(engine(tokens[step, :, :-1], tokens[step, :, 1:]))
            engine.step()
            lrs.append(engine.get_lr_of_last_step()[0])
            if query:
                counted.append(engine.skipped_steps)  # reads the verdict; never raises
            with zerotrain.zero.GatheredParameters(list(model.parameters())):
                snapshots.append(
                    torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
                )
    except FloatingPointError as exc:
        error = str(exc)
    return {
        "snapshots": snapshots,
        "skipped": engine.skipped_steps,
        "applied": engine.was_step_applied(),
        "warnings": captured.messages,
        "error": error,
        "lrs": lrs,
        "counted": counted,
        "next_lr": engine.get_lr()[0],
    }


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (3, "fp32"), (2, "bf16")])
def test_a_non_finite_step_is_skipped_on_every_rank_and_named(stage, dtype):
    """Steps 3 and 4 poisoned. Step 3's verdict stays on the device (no host sync) and is
    read at step 4, naming the unit; from then on verdicts are taken on the host until a
    step is finite, so step 4 is caught before it runs and names the parameter."""
    results = run_distributed(_train, 2, stage, dtype, [2, 3], {}, timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        assert r["skipped"] == 2, (rank, r["skipped"])
        shots = r["snapshots"]
        assert torch.equal(shots[2], shots[1]), "the poisoned step 3 changed the parameters"
        assert torch.equal(shots[3], shots[2]), "the poisoned step 4 changed the parameters"
        assert not torch.equal(shots[4], shots[3]), "training did not go on after the skips"
        assert all(torch.isfinite(s).all() for s in shots)
        warnings = [m for m in r["warnings"] if "inf/NaN" in m]
        assert len(warnings) == 2, warnings
        assert "step 3" in warnings[0], warnings[0]
        assert "step 4" in warnings[1], warnings[1]
        assert all("skipped on every rank" in w for w in warnings), warnings
    # The ranks whose slices hold wpe.weight name its unit for step 3 and the parameter
    # itself for step 4 (at stages 1-3 each rank owns a slice).
    named = [m for r in results for m in r["warnings"] if "first non-finite gradient" in m]
    assert any("step 3" in m and "(unit '" in m for m in named), named
    assert any("step 4" in m and m.endswith("wpe.weight") for m in named), named


def test_a_skipped_step_does_not_advance_the_schedule():
    """The scheduler steps at once after a step whose verdict stays on the device, and is
    put back when the verdict says the step was skipped (DeepSpeed does not advance the
    schedule on a skipped step): the rates are those of a run whose step 3 never ran."""
    clean = run_distributed(_train, 2, 1, "fp32", [], {}, True, timeout=120)[0]
    for r in run_distributed(_train, 2, 1, "fp32", [2], {}, True, timeout=120):
        assert r["skipped"] == 1
        used = clean["lrs"]
        assert used[1] != used[2] != used[3]  # still warming up: every step moves the rate
        assert r["lrs"] == [*used[:3], *used[2:5]]
        assert r["next_lr"] == used[5]


def test_a_query_reads_the_verdict_and_the_next_update_raises():
    """With max_consecutive_skips 1, step 2's skip (decided on the device) reaches the
    limit when ``skipped_steps`` reads its verdict: the query returns the count, and the
    next step's update raises, before that step changes anything."""
    section = {"max_consecutive_skips": 1}
    for r in run_distributed(_train, 2, 1, "fp32", [1], section, False, True, timeout=120):
        assert r["counted"] == [0, 1], r["counted"]
        assert r["error"] is not None, r
        assert "step 2" in r["error"], r["error"]
        assert "max_consecutive_skips=1" in r["error"], r["error"]
        assert len(r["snapshots"]) == 2  # steps 1-2 recorded; the 3rd step's update raised
        assert torch.equal(r["snapshots"][1], r["snapshots"][0])


def test_consecutive_skips_raise_naming_the_key():
    section = {"max_consecutive_skips": 3}
    for r in run_distributed(_train, 2, 1, "fp32", [1, 2, 3, 4], section, timeout=120):
        assert r["error"] is not None, r
        assert "step 4" in r["error"], r["error"]
        assert "max_consecutive_skips=3" in r["error"], r["error"]
        assert r["skipped"] == 3
        assert len(r["snapshots"]) == 3  # steps 1-3 recorded; the 4th raised


def test_action_raise_stops_at_the_first():
    for r in run_distributed(_train, 2, 1, "fp32", [2], {"action": "raise"}, timeout=120):
        assert r["error"] is not None, r
        assert "step 3" in r["error"], r["error"]
        assert "'raise'" in r["error"], r["error"]


def test_action_ignore_applies_the_update_as_before():
    # The old behaviour, for those who want no per-step synchronization.
    for r in run_distributed(_train, 2, 1, "fp32", [2], {"action": "ignore"}, timeout=120):
        assert r["error"] is None, r["error"]
        assert r["skipped"] == 0
        assert not torch.isfinite(r["snapshots"][2]).all()


def _norms_with_a_monitor(path: str) -> list[bool]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "non_finite_gradients": {"action": "ignore"},
        "steps_per_print": 1000,
        "csv_monitor": {"enabled": True, "output_path": path, "job_name": "norms"},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    reported = []
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
        reported.append(engine.get_global_grad_norm() is not None)
    return reported


def test_a_monitor_makes_every_rank_compute_the_norm(tmp_path):
    """With action "ignore" and no clipping the norm is computed only when something reads
    it; a monitor reads it every step, and is written by rank 0 only: deciding by "this
    rank writes" made rank 0 all-reduce the norm alone while rank 1 went on to the step's
    all-gather (found in review)."""
    for rank, reported in enumerate(
        run_distributed(_norms_with_a_monitor, 2, str(tmp_path), timeout=60, comm_timeout=15)
    ):
        assert reported == [True, True, True], rank
