"""Progressive layer drop, curriculum learning and random-LTD under the engine: each trains
exactly like one process of plain PyTorch on the whole global batch that makes the same
drop draws / truncation by hand (1e-5, clipping active, through a loss spike: random
targets at one step), at the ZeRO stages that stress
them (stage 3: a dropped block is neither gathered nor reduced); the curriculum also through
a pipeline, whose shapes change as the length grows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers import pipeline as pipe
from tests.helpers.training import (
    PARITY_ADAM,
    RunSpec,
    assert_matches,
    global_batches,
    make_model,
    micro_batch,
    reference_optimizer,
    zerotrain_config,
)
from zerotrain.efficiency.draws import shared_generator
from zerotrain.examples.gpt import GPTBlock, GPTConfig, GPTEmbedding, gpt_loss_fn
from zerotrain.testing.dist import run_distributed

MODEL = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32, bias=False)
PLD = {"enabled": True, "theta": 0.5, "gamma": 0.5, "seed": 3}


def _spec(stage: int, section: dict, steps: int = 6, model: GPTConfig = MODEL) -> RunSpec:
    return RunSpec(
        optimizer="AdamW",
        opt_params=dict(PARITY_ADAM),
        steps=steps,
        micro_batch=2,
        grad_accum=1,
        clip=0.5,  # active: the tiny GPT's gradient norm starts near 2
        stage=stage,
        model=model,
        extra_config=section,
    )


SPIKE_STEP = 3  # random targets: a loss spike, with clipping hard at work


def _batches(spec: RunSpec, world: int) -> torch.Tensor:
    """The global batches of every step, step ``SPIKE_STEP``'s targets random tokens."""
    batches = global_batches(spec, world).clone()
    noise = torch.Generator().manual_seed(7)
    spiked = batches[SPIKE_STEP, :, 1:]
    spiked.copy_(torch.randint(0, spec.model.vocab_size, spiked.shape, generator=noise))
    return batches


def _train(spec: RunSpec) -> dict:
    """Runs on every rank: train, recording the engine's schedule values per step."""
    model = make_model(spec)
    config = zerotrain_config(spec, dist.get_world_size())
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    seen: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    # Units whose reduction had been launched when backward ended: with layers dropped
    # they must not wait for gradients that never come.
    launched_in_backward: list[int] = []
    sync = engine.strategy.sync
    launch_remaining = sync.launch_remaining

    def recorded() -> None:
        launched_in_backward.append(sync._next)
        launch_remaining()

    sync.launch_remaining = recorded
    gathered: list[str] = []  # stage 3: the units gathered in the current step
    gatherer = engine.strategy.gatherer
    if gatherer is not None:
        issue = gatherer._issue

        def counted(u: int, count: bool = True):
            gathered.append(gatherer.units[u].label)
            return issue(u, count)

        gatherer._issue = counted
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(spec, world)
    losses, thetas, lengths, dropped, unmatched = [], [], [], [], []
    for step in range(spec.steps):
        x, y = micro_batch(batches, spec, step, 0, rank, world)
        gathered.clear()
        loss = engine(x, y)
        engine.backward(loss)
        pld = engine.efficiency.layer_drop
        if pld is not None:
            kept = [pld.decision(i)[0] for i in range(4)]
            dropped.append(kept.count(False))
            blocks = {label for label in gathered if label.startswith("blocks.")}
            if gatherer is not None and blocks != {f"blocks.{i}" for i in range(4) if kept[i]}:
                unmatched.append((step, kept, sorted(blocks)))
        engine.step()
        losses.append(engine.comm.all_reduce_floats([loss.item()])[0] / world)
        thetas.append(engine.get_pld_theta())
        lengths.append(engine.curriculum_seqlen)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "thetas": thetas,
        "lengths": lengths,
        "seen": seen,
        "dropped": dropped,
        "unmatched": unmatched,
        "units": [unit.label for unit in engine.strategy.units],
        "launched_in_backward": launched_in_backward,
    }


def _reference(spec: RunSpec, world: int, block_step) -> dict:
    """One process, the whole global batch; ``block_step(model, x, step)`` runs the blocks."""
    model = make_model(spec)
    opt = reference_optimizer(spec, list(model.parameters()))
    batches = _batches(spec, world)
    losses = []
    for step in range(spec.steps):
        x, y = batches[step, :, :-1], batches[step, :, 1:]
        h = model.drop(model.wte(x) + model.wpe(torch.arange(x.shape[1])))
        h = block_step(model, h, step)
        logits = model.lm_head(model.ln_f(h))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# -- progressive layer drop ---------------------------------------------------------------------


def _pld_blocks(model, h, step):
    # DeepSpeed's timing: the forward of step s uses theta(s - 1) (1.0 at s = 0), updated
    # at each optimizer step with the count before the increment.
    theta = 1.0 if step == 0 else (1 - 0.5) * float(torch.tensor(-0.5 * (step - 1)).exp()) + 0.5
    draws = torch.rand(4, generator=shared_generator(PLD["seed"], 1, step))
    for i, block in enumerate(model.blocks):
        p = 1 - (i + 1) / 4 * (1 - theta)
        if draws[i] < p:
            h = h + (block(h) - h) / p
    return h


@pytest.mark.parametrize("stage", [2, 3])
def test_pld_matches_one_process_with_the_same_draws(stage):
    # Blocks below the persistence threshold would stay gathered: 0 makes every one a unit
    # that is gathered around each use.
    zero = {"stage": stage, "reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 0}
    spec = _spec(3, {"progressive_layer_drop": PLD, "zero_optimization": zero})
    reference = _reference(spec, 2, _pld_blocks)
    results = run_distributed(_train, 2, spec)
    for result in results:
        assert_matches(result, reference)
    assert results[0]["dropped"] == results[1]["dropped"]  # the same draws on both ranks
    assert sum(results[0]["dropped"]) >= 3  # layers were really dropped
    # Stage 3 gathered exactly the kept blocks (a dropped one is neither run nor prefetched).
    assert results[0]["unmatched"] == []
    # Every step launched as many reductions while backward ran as the first one, which
    # drops nothing (all units; at stage 3 all but the root, whose backward ends last).
    launched, units = results[0]["launched_in_backward"], len(results[0]["units"])
    assert launched == [units if stage < 3 else units - 1] * spec.steps
    # theta after step i is (1 - theta) * exp(-gamma * i) + theta (DeepSpeed's model test).
    expected = [
        0.5 * float(torch.tensor(-0.5 * i, dtype=torch.float64).exp()) + 0.5
        for i in range(spec.steps)
    ]
    assert results[0]["thetas"] == pytest.approx(expected, abs=1e-15)


# -- curriculum ---------------------------------------------------------------------------------

CURRICULUM = {
    "curriculum_learning": {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 4,
        "max_difficulty": 16,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 4, "root_degree": 2},
    }
}


def _length(step: int) -> int:
    # fixed_root at global step + 1: 4 + floor(sqrt((s + 1) / 5) * 12), down to a multiple of 4.
    value = int(4 + ((step + 1) / 5) ** 0.5 * 12)
    return min(value - value % 4, 16)


def test_curriculum_follows_the_schedule_and_matches_one_process():
    spec = _spec(2, CURRICULUM, steps=6)
    lengths = [_length(s) for s in range(spec.steps)]
    assert lengths == [8, 8, 12, 12, 16, 16]  # by hand: sqrt(.2)*12=5.4, sqrt(.6)*12=9.3, ...
    model = make_model(spec)
    opt = reference_optimizer(spec, list(model.parameters()))
    batches = _batches(spec, 2)
    ref_losses = []
    for step, length in enumerate(lengths):
        loss = model(batches[step, :, :-1][:, :length], batches[step, :, 1:][:, :length])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip)
        opt.step()
        ref_losses.append(loss.item())
    reference = {
        "losses": ref_losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
    for result in run_distributed(_train, 2, spec):
        assert result["lengths"] == lengths
        assert result["seen"] == lengths  # what the model's blocks really got
        assert_matches(result, reference)


def test_data_efficiency_seqlen_truncate_metric_acts_like_the_legacy_block():
    legacy = CURRICULUM["curriculum_learning"]
    metric = {k: legacy[k] for k in ("min_difficulty", "max_difficulty", "schedule_type")}
    metric["schedule_config"] = legacy["schedule_config"]
    sampling = {
        "enabled": True,
        "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen_truncate": metric}},
    }
    spec = _spec(0, {"data_efficiency": {"enabled": True, "data_sampling": sampling}}, steps=5)
    (result,) = run_distributed(_train, 1, spec)
    assert result["seen"] == result["lengths"] == [_length(s) for s in range(5)]


def _train_pipeline_with_curriculum(run: pipe.PipeRun) -> dict:
    module = pipe.pipeline_module(run.stages)
    config = {**run.config(1), **CURRICULUM}
    engine, _, _, _ = zerotrain.initialize(model=module, config=config)
    seen: list[int] = []
    # What this stage's first layer receives (the embedding's tokens, or hidden states).
    first = next(m for m in module.modules() if isinstance(m, (GPTEmbedding, GPTBlock)))

    def record(_module, args):
        inputs = args[0][0] if isinstance(args[0], tuple) else args[0]
        seen.append(inputs.shape[1])

    first.register_forward_pre_hook(record)
    losses = []
    for step in range(run.steps):
        losses.append(float(engine.train_batch(iter(pipe.micro_batches(engine, step, 2)))))
    return {"losses": losses, "params": pipe.stage_params(engine), "seen": seen}


def test_curriculum_through_a_pipeline_reexchanges_shapes_and_matches_one_process():
    run = pipe.PipeRun(2, "1f1b", zero_stage=1, steps=5, micro_batches=2)
    lengths = [_length(s) for s in range(run.steps)]
    module = pipe.pipeline_module(1)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=PARITY_ADAM["lr"],
        weight_decay=PARITY_ADAM["weight_decay"],
        eps=PARITY_ADAM["eps"],
    )
    batches = pipe.pipeline_batches(2, 1)
    ref_losses = []
    for step, length in enumerate(lengths):
        x, y = batches[step, :, :-1][:, :length], batches[step, :, 1:][:, :length]
        loss = gpt_loss_fn(module(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, pipe.SPEC.clip)
        opt.step()
        ref_losses.append(loss.item())
    reference = {
        "losses": ref_losses,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }
    results = run_distributed(_train_pipeline_with_curriculum, 2, run, timeout=240)
    for rank, result in enumerate(results):
        problems = pipe.mismatches(result, reference, 1e-5)
        assert not problems, f"rank {rank}: " + "; ".join(problems)
        # Each stage's first layer saw two micro-batches per step at the schedule's length.
        assert result["seen"] == [n for n in lengths for _ in range(2)]


# -- random-LTD ---------------------------------------------------------------------------------

LTD_SEED = 11
RANDOM_LTD = {
    "data_efficiency": {
        "enabled": True,
        "seed": LTD_SEED,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 4,
                "random_ltd_layer_num": 2,
                "random_ltd_layer_id": [1, 2],
                "model_mask_name": "attention_mask",
                "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {
                    "min_value": 8,
                    "max_value": 16,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": 4, "seq_per_step": 4},
                },
            },
        },
    }
}


def _ltd_blocks(model, h, step):
    kept = min(8 + int(step / 4 * 8) // 4 * 4, 16)  # 8, 8, 12, 12, 16, ...
    if kept >= h.shape[1]:
        return torch.nn.Sequential(*model.blocks)(h)
    scores = torch.rand(2, h.shape[0], h.shape[1], generator=shared_generator(LTD_SEED, 2, step))
    rows = scores.argsort(-1)[..., :kept].sort(-1).values
    h = model.blocks[0](h)
    for layer, block in enumerate(model.blocks[1:3]):
        index = rows[layer][..., None].expand(-1, -1, h.shape[-1])
        h = h.scatter(1, index, block(h.gather(1, index)))
    return model.blocks[3](h)


@pytest.mark.parametrize("stage", [2, 3])
def test_random_ltd_matches_one_process_with_the_same_token_draws(stage):
    spec = _spec(stage, RANDOM_LTD, steps=5)
    reference = _reference(spec, 2, _ltd_blocks)
    for result in run_distributed(_train, 2, spec):
        assert_matches(result, reference)
        if stage == 3:  # the LTD blocks and the plain ones are all units of their own
            assert sorted(result["units"])[-4:] == [f"blocks.{i}" for i in range(4)]


# -- refusals -----------------------------------------------------------------------------------


def _initialize_error(config: dict, pipeline: bool) -> str:
    model = pipe.pipeline_module(2) if pipeline else make_model(_spec(0, {}))
    try:
        batch = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
        zerotrain.initialize(model=model, config={**batch, **config})
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(
    ("config", "pipeline", "needle"),
    [
        ({"progressive_layer_drop": PLD}, True, "progressive_layer_drop runs with data parallel"),
        ({"progressive_layer_drop": PLD, **RANDOM_LTD}, False, "enable one of them"),
        (
            {
                "data_efficiency": {
                    **RANDOM_LTD["data_efficiency"],
                    "data_routing": {
                        "enabled": True,
                        "random_ltd": {
                            **RANDOM_LTD["data_efficiency"]["data_routing"]["random_ltd"],
                            "total_layer_num": 6,
                        },
                    },
                }
            },
            False,
            "total_layer_num is 6, but the model's block list 'blocks' has 4 layers",
        ),
    ],
    ids=["pld-pipeline", "pld-and-ltd", "ltd-layer-count"],
)
def test_refusals_name_the_section(config, pipeline, needle):
    (message, *_) = run_distributed(_initialize_error, 2 if pipeline else 1, config, pipeline)
    assert needle in message


def test_pld_on_transformers_gpt2_at_stage_3():
    transformers = pytest.importorskip("transformers")
    run_distributed(_hf_pld, 2, transformers.__name__)


def _hf_pld(_name: str) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=4, n_head=2)
    )
    config = {
        "train_batch_size": 4,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "progressive_layer_drop": {"enabled": True, "theta": 0.3, "gamma": 1.0},
    }
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    dropped = 0
    for _ in range(5):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss
        dropped += 4 - sum(engine.efficiency.layer_drop.decision(i)[0] for i in range(4))
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    assert dropped > 0


class _TakesDeepSpeedKwargs(torch.nn.Module):
    """A model written for DeepSpeed: it reads pld_theta and curriculum_seqlen itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 8)
        self.head = torch.nn.Linear(8, 256)
        self.calls: list[tuple] = []

    def forward(
        self, idx, targets, progressive_layer_drop=False, pld_theta=1.0, curriculum_seqlen=None
    ):
        self.calls.append((progressive_layer_drop, pld_theta, curriculum_seqlen, idx.shape[1]))
        logits = self.head(self.embed(idx))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# Layer drop for a model that drops its own layers, as DeepSpeed's models do.
OWN_LAYER_DROP = {
    "train_batch_size": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1},
}


def _kwargs_job(_: None) -> list[tuple]:
    torch.manual_seed(0)
    model = _TakesDeepSpeedKwargs()
    config = {**OWN_LAYER_DROP, **CURRICULUM}
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    for _step in range(3):
        x = torch.randint(0, 256, (2, 17))
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    engine.eval()
    engine(x[:, :-1], x[:, 1:])  # evaluation: no kwargs, no truncation
    return model.calls


def test_models_that_take_deepspeeds_kwargs_receive_them():
    (calls,) = run_distributed(_kwargs_job, 1, None)
    theta1 = 0.5 * float(torch.tensor(-0.1, dtype=torch.float64).exp()) + 0.5
    assert calls[:3] == [
        (True, 1.0, 8, 8),
        (True, 1.0, 8, 8),
        (True, pytest.approx(theta1), 12, 12),
    ]
    assert calls[3] == (False, 1.0, None, 16)


class _ReadsKwargs(torch.nn.Module):
    """DeepSpeed's PLD_SimpleModel (its unit tests) and bing_bert's way: the drop arguments
    arrive through **kwargs; no block list for zerotrain to drop instead."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.calls: list[tuple] = []

    def forward(self, x, y, **kwargs):
        self.calls.append(
            (kwargs.get("progressive_layer_drop", False), kwargs.get("pld_theta", 1.0))
        )
        return torch.nn.functional.mse_loss(self.linear(x), y)


def _kwargs_pld_job(_: None) -> list[tuple]:
    torch.manual_seed(0)
    model = _ReadsKwargs()
    engine, _, _, _ = zerotrain.initialize(model=model, config=OWN_LAYER_DROP)
    for _step in range(4):
        engine.backward(engine(torch.randn(2, 8), torch.randn(2, 8)))
        engine.step()
    engine.eval()
    engine(torch.randn(2, 8), torch.randn(2, 8))  # evaluation: no drop arguments
    return model.calls


def test_models_that_read_the_drop_arguments_from_kwargs_receive_them():
    (calls,) = run_distributed(_kwargs_pld_job, 1, None)
    # DeepSpeed's formula: theta(t) = (1 - theta) * exp(-gamma * t) + theta, t the step.
    theta = [0.5 * float(torch.tensor(-0.1 * t, dtype=torch.float64).exp()) + 0.5 for t in (1, 2)]
    assert calls == [
        (True, 1.0),
        (True, 1.0),
        (True, pytest.approx(theta[0])),
        (True, pytest.approx(theta[1])),
        (False, 1.0),
    ]


def _resume_job(directory: str) -> dict:
    spec = _spec(2, {"progressive_layer_drop": PLD, **CURRICULUM}, steps=6)

    def fresh():
        model = make_model(spec)
        config = zerotrain_config(spec, dist.get_world_size())
        return zerotrain.initialize(model=model, config=config)[0]

    def steps(engine, first, last):
        batches = _batches(spec, 1)
        out = []
        for step in range(first, last):
            x, y = micro_batch(batches, spec, step, 0, 0, 1)
            loss = engine(x, y)
            out.append((loss.item(), engine.get_pld_theta(), engine.curriculum_seqlen))
            engine.backward(loss)
            engine.step()
        return out

    straight = steps(fresh(), 0, 6)
    engine = fresh()
    first = steps(engine, 0, 3)
    engine.save_checkpoint(directory)
    resumed = fresh()
    resumed.load_checkpoint(directory)
    return {"straight": straight, "resumed": first + steps(resumed, 3, 6)}


def test_layer_drop_and_curriculum_resume_exactly(tmp_path):
    (result,) = run_distributed(_resume_job, 1, str(tmp_path))
    assert result["resumed"] == result["straight"]  # losses, theta and length, bit for bit
