"""Jobs on a grid of more than one axis: ZeRO shards over the data group only.

A tensor axis with nothing to split the model by (no tensor_parallel section, a model
without a plan) runs replicated compute: the two ranks of a tensor group hold the same
model and read the same samples (the demo GPT's own plan is switched off here; tensor
parallelism proper is tests/dist/test_tensor_parallel_*.py). With ``Topology(data=2,
tensor=2)`` on 4 ranks, ZeRO must then keep the 2-way shard on each rank (not the 4-way
one), reduce over the 2-rank data group, and train exactly like one process on the global
batch of the 2 data-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    train_reference,
    zerotrain_config,
)
from zerotrain.parallel import ProcessGroups, Topology
from zerotrain.testing.dist import run_distributed

GRID = Topology(data=2, tensor=2)


def _unplanned(model: torch.nn.Module) -> torch.nn.Module:
    model._tp_plan = {}  # no plan: the tensor axis replicates compute
    return model


def _train_on_grid(stage: int) -> dict:
    spec = RunSpec(stage=stage, steps=4, opt_params=dict(PARITY_ADAM))
    model = _unplanned(make_model(spec))
    data_world = GRID.data
    engine, _, _, _ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, data_world), topology=GRID
    )
    groups: ProcessGroups = engine.groups
    batches = global_batches(spec, data_world)
    losses = []
    for step in range(spec.steps):
        total = 0.0
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, engine.dp_rank, data_world)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        losses.append(groups.data.all_reduce_floats([total])[0] / (data_world * spec.grad_accum))
    breakdown = engine.memory_breakdown()
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = engine.comm_stats()
    return {
        "losses": losses,
        "params": params,
        "ranks": (engine.global_rank, engine.dp_rank, engine.dp_world_size, engine.tp_rank),
        "zero_group": (groups.zero.world_size, groups.tensor.world_size),
        "model_state_bytes": breakdown.params + breakdown.grads + breakdown.optimizer_states,
        "gradient_bytes": stats.get(purpose="gradients").payload_bytes,
        "numel": sum(p.numel() for p in model.parameters()),
    }


def _model_state_bytes_two_way(stage: int) -> int:
    """The same model, trained by a plain 2-rank job: its per-rank model-state bytes."""
    spec = RunSpec(stage=stage, steps=1, opt_params=dict(PARITY_ADAM))
    model = _unplanned(make_model(spec))
    engine, _, _, _ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, engine.dp_rank, 2)
    for _ in range(spec.grad_accum):
        engine.backward(engine(x, y))
        engine.step()
    breakdown = engine.memory_breakdown()
    return breakdown.params + breakdown.grads + breakdown.optimizer_states


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_shards_over_the_data_group_of_a_data_by_tensor_grid(stage):
    results = run_distributed(_train_on_grid, 4, stage, timeout=240)
    two_way = run_distributed(_model_state_bytes_two_way, 2, stage, timeout=120)
    reference = train_reference(RunSpec(stage=stage, steps=4, opt_params=dict(PARITY_ADAM)), 2)
    # Megatron's layout: tensor fastest, so ranks 0 and 1 are one tensor group.
    assert [r["ranks"] for r in results] == [(0, 0, 2, 0), (1, 0, 2, 1), (2, 1, 2, 0), (3, 1, 2, 1)]
    for rank, got in enumerate(results):
        assert got["zero_group"] == (2, 2)
        # Per-rank model states are the 2-way figure, not the 4-way one.
        assert got["model_state_bytes"] == two_way[rank % 2], (rank, got, two_way)
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5
        )
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5)
    # The tensor axis adds no gradient traffic: one reduction of the model per step at
    # stage 1 and one per micro-step at stage 3 (fp32, plus padding), as on 2 plain ranks.
    reductions = 4 * (1 if stage == 1 else 2)
    numel = results[0]["numel"]
    for got in results:
        assert reductions * numel * 4 <= got["gradient_bytes"] < reductions * numel * 4 * 1.1


def _topology_mismatch() -> str:
    spec = RunSpec(steps=1)
    try:
        zerotrain.initialize(
            model=make_model(spec), config=zerotrain_config(spec, 3), topology=Topology(data=3)
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_topology_that_does_not_match_the_job_is_refused():
    for message in run_distributed(_topology_mismatch, 2, timeout=60):
        assert "topology data=3" in message.replace("pipe=1 x ", "").replace(
            " x sequence=1 x tensor=1", ""
        ), message
        assert "has 3 ranks, but the job has 2" in message, message


def _save_on_grid(path: str) -> dict:
    spec = RunSpec(stage=3, steps=2, opt_params=dict(PARITY_ADAM))
    model = _unplanned(make_model(spec))
    engine, _, _, _ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, GRID.data), topology=GRID
    )
    batches = global_batches(spec, GRID.data)
    for step in range(spec.steps):
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, engine.dp_rank, GRID.data)
            engine.backward(engine(x, y))
            engine.step()
    engine.save_checkpoint(path, tag="grid")
    with zerotrain.zero.GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_plain(path: str, stage: int) -> dict:
    spec = RunSpec(stage=stage, steps=1, opt_params=dict(PARITY_ADAM))
    model = _unplanned(make_model(spec))
    engine, _, _, _ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    engine.load_checkpoint(path, tag="grid")
    with zerotrain.zero.GatheredParameters(model.parameters()):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_checkpoint_saved_on_a_grid_loads_on_plain_ranks(tmp_path):
    # Tensor peers hold the same shards: the manifest keeps one copy of each fragment, and
    # the files are named by global rank.
    saved = run_distributed(_save_on_grid, 4, str(tmp_path), timeout=240)[0]
    files = sorted(p.name for p in (tmp_path / "grid").iterdir())
    assert [f for f in files if f.endswith(".safetensors")] == [
        f"rank{r:05d}.safetensors" for r in range(4)
    ]
    for loaded in run_distributed(_load_plain, 2, str(tmp_path), 1, timeout=120):
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
