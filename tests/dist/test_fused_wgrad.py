"""``gradient_accumulation_fusion`` through the engine: on the micro-steps that reduce nothing,
large ``nn.Linear`` weights get their gradient added into the gradient buffer in place
(``aten::addmm_``), and training equals one process training the same global batch
(clipping active), at ZeRO stages 0-1 over 2 data-parallel ranks, on a 2-stage pipeline,
and compiled by ``engine.compile()`` (whose graph keeps autograd's path). With the key off,
no in-place add happens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from tests.helpers.training import PARITY_ADAM
from zerotrain.pipe import LayerSpec, PipelineModule
from zerotrain.testing.dist import run_distributed
from zerotrain.zero.fused_wgrad import SMALLEST_FUSED_WEIGHT

WIDTH = 1024  # WIDTH**2 weights: large enough to be fused
MICRO, ACCUM, STEPS, CLIP = 2, 3, 3, 0.05
assert WIDTH * WIDTH >= SMALLEST_FUSED_WEIGHT


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh()]


def _batches(world_micro_batches: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(world_micro_batches * MICRO, WIDTH, generator=g) for _ in range(STEPS)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _config(stage: int, fused: bool, pipeline: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": dict(PARITY_ADAM)},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "gradient_accumulation_fusion": fused,
        "steps_per_print": 1000,
    }
    if pipeline:
        config["pipeline"] = {"stages": 2, "schedule": "1f1b"}
    return config


def _reference(micro_batches: int) -> tuple[list[float], list[torch.Tensor]]:
    """One process, the whole global batch per step, torch's clipping and AdamW."""
    model = nn.Sequential(*_layers())
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    losses = []
    for batch in _batches(micro_batches):
        loss = _loss(model(batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _in_place_adds(run) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    with torch.profiler.profile() as prof:
        result = run()
    return result, sum(1 for e in prof.events() if e.name == "aten::addmm_")


def _train_windows(engine: zerotrain.Engine) -> list[float]:
    """Each step's ACCUM micro-steps on this rank's share of the global batch; the mean
    loss of each step on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in _batches(world * ACCUM):
        mine = batch.chunk(world * ACCUM)[rank * ACCUM : (rank + 1) * ACCUM]
        total = 0.0
        for x in mine:
            loss = _loss(engine(x))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / ACCUM)
    return losses


def _train_data_parallel(stage: int, fused: bool) -> dict:
    engine, _, _, _ = zerotrain.initialize(
        model=nn.Sequential(*_layers()), config=_config(stage, fused, pipeline=False)
    )
    losses, adds = _in_place_adds(lambda: _train_windows(engine))
    params = [p.detach().clone() for p in engine.module.parameters()]  # whole at 0-1
    engine.destroy()
    return {"losses": losses, "params": params, "adds": adds}


def _train_compiled() -> dict:
    """engine.compile() over fused layers: the compiled graph holds plain F.linear (the
    fused backward is for eager code), and training is the same."""
    engine, _, _, _ = zerotrain.initialize(
        model=nn.Sequential(*_layers()), config=_config(1, True, pipeline=False)
    )
    engine.compile(backend="aot_eager")
    losses = _train_windows(engine)
    params = [p.detach().clone() for p in engine.module.parameters()]
    return {"losses": losses, "params": params}


def _train_pipeline(fused: bool) -> dict:
    module = PipelineModule(
        [
            LayerSpec(type(m), *([WIDTH, WIDTH] if isinstance(m, nn.Linear) else []))
            for m in _layers()
        ],
        num_stages=2,
        loss_fn=lambda out, _y: _loss(out),
        partition_method="uniform",
    )
    reference = nn.Sequential(*_layers())
    mine = dict(module.named_parameters())
    with torch.no_grad():  # the reference's initial values, wherever the layers landed
        for name, p in reference.named_parameters():
            if name in mine:
                mine[name].copy_(p)
    engine, _, _, _ = zerotrain.initialize(model=module, config=_config(1, fused, pipeline=True))

    def run() -> list[float]:
        losses = []
        for batch in _batches(ACCUM):
            pairs = [(x, x) for x in batch.chunk(ACCUM)]
            losses.append(float(engine.train_batch(iter(pairs))))
        return losses

    losses, adds = _in_place_adds(run)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "adds": adds}


@pytest.mark.parametrize("stage", [0, 1])
def test_fused_accumulation_trains_like_one_process(stage: int) -> None:
    want_losses, want_params = _reference(2 * ACCUM)
    for fused in (True, False):
        ranks = run_distributed(_train_data_parallel, 2, stage, fused, timeout=240)
        mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
        torch.testing.assert_close(mean, want_losses, rtol=1e-5, atol=1e-6)
        for got in ranks:
            for p, want in zip(got["params"], want_params, strict=True):
                torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)
        # Both weights, on the ACCUM - 1 micro-steps of each step that reduce nothing.
        want_adds = 2 * (ACCUM - 1) * STEPS if fused else 0
        assert [got["adds"] for got in ranks] == [want_adds, want_adds]


def test_compiled_model_with_fused_layers_trains_like_one_process() -> None:
    want_losses, want_params = _reference(2 * ACCUM)
    own = "torch.compile patches nn.Module for the process's life"
    ranks = run_distributed(_train_compiled, 2, timeout=240, own_processes=own)
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(mean, want_losses, rtol=1e-5, atol=1e-6)
    for got in ranks:
        for p, want in zip(got["params"], want_params, strict=True):
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)


def test_fused_accumulation_on_a_pipeline_trains_like_one_process() -> None:
    want_losses, want_params = _reference(ACCUM)
    by_name = dict(zip(("0.weight", "0.bias", "2.weight", "2.bias"), want_params, strict=True))
    ranks = run_distributed(_train_pipeline, 2, True, timeout=240)
    torch.testing.assert_close(ranks[-1]["losses"], want_losses, rtol=1e-5, atol=1e-6)
    for got in ranks:
        assert got["adds"] > 0
        for name, p in got["params"].items():
            torch.testing.assert_close(p, by_name[name], rtol=1e-5, atol=1e-6)
