"""Several tied modules across stages, met in different orders, train like one process.

Key ``a`` is used on layers 0, 3 and 5 and key ``b`` on layers 1 and 4, so with 3 stages
``a`` is held by every stage and ``b`` by the first and last, and with 2 stages the first
stage meets ``a`` then ``b`` while the last meets ``b`` then ``a``. The copies' gradients
are summed per key among their holders without hanging, and every loss and parameter matches
a single process where each key is one shared module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerotrain.testing.dist import run_distributed

WIDTH, MICRO, ROWS, STEPS = 8, 4, 4, 6


def _layers() -> list:
    return [
        TiedLayerSpec("a", nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("b", nn.Linear, WIDTH, WIDTH),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("a", nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("b", nn.Linear, WIDTH, WIDTH),
        TiedLayerSpec("a", nn.Linear, WIDTH, WIDTH),
    ]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batches(data_parallel: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    rows = ROWS * MICRO * data_parallel
    return torch.randn(STEPS, rows, WIDTH, generator=gen), torch.randn(
        STEPS, rows, WIDTH, generator=gen
    )


def _train(stages: int, zero_stage: int) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    module = PipelineModule(
        _layers(), num_stages=stages, loss_fn=_mse, seed_layers=True, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": MICRO,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zerotrain.initialize(model=module, config=config)
    data, rank = world // stages, engine.groups.data.rank
    xs, ys = _batches(data)
    losses = []
    for step in range(STEPS):
        pairs = []
        for m in range(MICRO):
            rows = slice((m * data + rank) * ROWS, (m * data + rank + 1) * ROWS)
            pairs.append((xs[step, rows], ys[step, rows]))
        losses.append(float(engine.train_batch(iter(pairs))))
    with zerotrain.zero.GatheredParameters(list(module.parameters())):
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": losses, "params": params, "ties": sorted(g.key for g in engine.ties)}


def _reference(data_parallel: int) -> dict:
    module = PipelineModule(_layers(), num_stages=1, stage_id=0, loss_fn=_mse, seed_layers=True)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    xs, ys = _batches(data_parallel)
    losses = []
    for step in range(STEPS):
        loss = _mse(module(xs[step]), ys[step])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


@pytest.mark.parametrize(("stages", "world", "zero_stage"), [(2, 4, 2), (3, 3, 3), (3, 3, 1)])
def test_several_tie_keys_in_any_order(stages, world, zero_stage):
    results = run_distributed(_train, world, stages, zero_stage, timeout=180, comm_timeout=30)
    reference = _reference(world // stages)
    if stages == 3:
        assert [r["ties"] for r in results] == [["a", "b"], ["a"], ["a", "b"]]
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=1e-5
        )
        for name, value in result["params"].items():
            diff = (value - reference["params"][name]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: {name} differs by {diff:.2e}"
