"""Engine behaviour around the training step: user optimizers and schedules at every stage,
data loading, logging, the engine's lifecycle, and clear errors for misuse."""

from __future__ import annotations

import logging

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
    run_training,
    train_reference,
    zerotrain_config,
)
from zerotrain.testing.dist import DistributedTestError, run_distributed

ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6}


# -- user optimizers and schedules ------------------------------------------------------------


def _user_optimizer(stage: int, kind: str) -> dict:
    spec = RunSpec(steps=6, stage=stage, opt_params=ADAMW)
    model = make_model(spec)
    config = {
        k: v for k, v in zerotrain_config(spec, dist.get_world_size()).items() if k != "optimizer"
    }
    if kind == "object":
        passed = torch.optim.AdamW(model.parameters(), **ADAMW)
        engine, returned, _, _ = zerotrain.initialize(model=model, optimizer=passed, config=config)
        assert (returned is passed) == (stage == 0)  # rebuilt over shards at stages >= 1
        assert isinstance(returned, torch.optim.AdamW)
    else:
        engine, returned, _, sched = zerotrain.initialize(
            model=model,
            optimizer=lambda params: torch.optim.AdamW(params, **ADAMW),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
            config=config,
        )
        assert sched is not None
        assert sched.optimizer is returned
    return run_training(engine, spec, model)


@pytest.mark.parametrize("kind", ["object", "callable"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_user_optimizer_matches_reference_at_every_stage(stage, kind):
    got = run_distributed(_user_optimizer, 2, stage, kind)[0]
    spec = RunSpec(steps=6, stage=stage, opt_params=ADAMW)
    if kind == "object":
        assert_matches(got, train_reference(spec, 2))
    else:
        # StepLR (halved every 2 steps): step 6 ran at 1e-3 * 0.5**2; the group already
        # holds step 7's 0.5**3, which get_lr reports (DeepSpeed's meaning).
        assert got["lr"] == [pytest.approx(1e-3 * 0.5**2)]
        assert got["current_lr"] == [pytest.approx(1e-3 * 0.5**3)]


def _scheduler_object_with_rebuilt_optimizer() -> str:
    model = make_model(RunSpec())
    passed = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(passed, step_size=1)
    try:
        zerotrain.initialize(
            model=model,
            optimizer=passed,
            lr_scheduler=sched,
            config={"train_batch_size": 2, "zero_optimization": {"stage": 1}},
        )
    except ValueError as err:
        return str(err)
    return "no error"


def test_scheduler_object_for_a_replaced_optimizer_is_refused():
    message = run_distributed(_scheduler_object_with_rebuilt_optimizer, 2)[0]
    assert "pass the scheduler as a callable" in message


class _NormClipping(torch.optim.SGD):
    """Not in the elementwise allow-list (it could look at whole parameters)."""


def _non_elementwise_optimizer() -> str:
    model = make_model(RunSpec())
    try:
        zerotrain.initialize(
            model=model,
            optimizer=_NormClipping(model.parameters(), lr=0.1),
            config={"train_batch_size": 2, "zero_optimization": {"stage": 2}},
        )
    except TypeError as err:
        return str(err)
    return "no error"


def test_unknown_optimizer_class_is_refused_when_states_are_partitioned():
    message = run_distributed(_non_elementwise_optimizer, 2)[0]
    assert "_NormClipping cannot step zerotrain's flat shards" in message


def _config_schedule() -> list[float]:
    spec = RunSpec(steps=5, grad_accum=1, opt_params={"lr": 0.01})
    model = make_model(spec)
    config = {
        **zerotrain_config(spec, 2),
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    lrs = [engine.get_lr()[0]]
    used = [engine.get_lr_of_last_step()[0]]
    batches = global_batches(spec, 2)
    for step in range(spec.steps):
        x, y = micro_batch(batches, spec, step, 0, dist.get_rank(), 2)
        engine.backward(engine(x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
        used.append(engine.get_lr_of_last_step()[0])
    return lrs, used


def test_config_schedule_drives_the_optimizer_lr():
    lrs, used = run_distributed(_config_schedule, 2)[0]
    # DeepSpeed's schedule; max lr = optimizer's. get_lr_of_last_step reports the rate the
    # last step used (before any step: the first step's), so that list is the rates of
    # steps 1..5 after the rate before step 1; get_lr (DeepSpeed's) is the group's rate now,
    # after step k already step k + 1's.
    assert used == pytest.approx([0.0, 0.0, 0.0, 0.0025, 0.005, 0.0075])
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01])


def _generator_and_extra_group_keys() -> int:
    model = make_model(RunSpec())
    groups = [{"params": list(model.parameters()), "name": "everything"}]
    _engine, opt, _, _ = zerotrain.initialize(
        model=model,
        model_parameters=(g for g in groups),  # a generator, read once
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        config={"train_batch_size": 2},
    )
    return len(opt.param_groups[0]["params"])


def test_model_parameters_generator_and_named_groups():
    count = run_distributed(_generator_and_extra_group_keys, 2)[0]
    assert count == len(list(make_model(RunSpec()).parameters()))


# -- data and logging -------------------------------------------------------------------------


class _Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _epochs_seen() -> list[list[int]]:
    model = torch.nn.Linear(1, 1)
    _, _, loader, _ = zerotrain.initialize(
        model=model, training_data=_Indexed(), config={"train_micro_batch_size_per_gpu": 4}
    )
    assert loader is not None
    assert len(loader) == 3
    return [[int(i) for batch in loader for i in batch.view(-1)] for _ in range(2)]


def test_training_data_is_split_across_ranks_and_reshuffled_each_epoch():
    per_rank = run_distributed(_epochs_seen, 2)
    for epoch in range(2):
        seen = per_rank[0][epoch] + per_rank[1][epoch]
        assert sorted(seen) == list(range(24))  # disjoint, complete
    assert per_rank[0][0] != per_rank[0][1]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _step_log() -> list[str]:
    capture = _Capture()
    logging.getLogger("zerotrain").addHandler(capture)
    spec = RunSpec(steps=4, grad_accum=1)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(
        model=model, config={**zerotrain_config(spec, 2), "steps_per_print": 2}
    )
    run_training(engine, spec, model)
    return [m for m in capture.messages if m.startswith("step ")]


def test_steps_per_print_logs_loss_lr_and_throughput():
    lines = run_distributed(_step_log, 2)
    assert len(lines[0]) == 2  # steps 2 and 4
    assert lines[0][0].startswith("step 2: loss ")
    for field in ("lr [", "grad norm", "samples/s"):
        assert field in lines[0][0]


# -- lifecycle and misuse ---------------------------------------------------------------------


def _wrap_twice() -> str:
    model = make_model(RunSpec())
    config = {"train_batch_size": 2}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    try:
        zerotrain.initialize(model=model, config=config)
    except ValueError as err:
        message = str(err)
    else:
        return "no error"
    engine.destroy()
    zerotrain.initialize(model=model, config=config)  # fine once the first engine let go
    return message


def test_wrapping_a_model_twice_is_refused_until_destroy():
    assert "already wrapped by a zerotrain engine" in run_distributed(_wrap_twice, 2)[0]


def _fail_once_then_train(stage: int) -> dict:
    spec = RunSpec(steps=3, grad_accum=2, stage=stage, opt_params=ADAMW)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    engine.backward(engine(x, y))  # micro-step 0 of a window, accumulated...
    engine.step()
    hook = model.blocks[0].register_full_backward_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.backward(engine(x, y))  # ...then backward fails on every rank
    hook.remove()
    return run_training(engine, spec, model)  # the window starts over; training goes on


@pytest.mark.parametrize("stage", [0, 2])
def test_training_continues_after_backward_raises(stage):
    got = run_distributed(_fail_once_then_train, 2, stage)[0]
    assert_matches(got, train_reference(RunSpec(steps=3, grad_accum=2, opt_params=ADAMW), 2))


def _misuse(case: str) -> str:
    spec = RunSpec(steps=1, grad_accum=1)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    try:
        if case == "step-without-backward":
            engine.step()
        elif case == "no-grad-loss":
            with torch.no_grad():
                engine.backward(engine(x, y))
    except (RuntimeError, TypeError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("step-without-backward", "step() called without a backward pass"),
        ("no-grad-loss", "the loss does not require grad"),
    ],
)
def test_misuse_gets_a_clear_error(case, message):
    for got in run_distributed(_misuse, 2, case):
        assert message in got


def _different_models() -> None:
    torch.manual_seed(0)
    width = 8 if dist.get_rank() == 0 else 9
    zerotrain.initialize(model=torch.nn.Linear(width, 2), config={"train_batch_size": 2})


def test_ranks_with_different_models_fail_fast():
    with pytest.raises(DistributedTestError, match="the ranks built different models") as err:
        run_distributed(_different_models, 2, timeout=60)
    # Both ranks fail, and the message names the parameter and each rank's shape.
    for rank in (0, 1):
        assert f"rank {rank} of 2 raised" in str(err.value)
    assert (
        "'parameter #0': rank 0 has 'weight' (2, 8) torch.float32, rank 1 has 'weight' (2, 9)"
        in str(err.value)
    )


def _different_configs(kind: str) -> None:
    rank = dist.get_rank()
    config: dict = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if kind == "lr":
        config["optimizer"]["params"]["lr"] = 1e-3 * (1 + rank)
    else:  # a key present on one rank only
        config["gradient_clipping"] = 1.0 if rank == 1 else 0.0
    zerotrain.initialize(model=torch.nn.Linear(4, 2), config=config)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("lr", "'optimizer.params.lr': rank 0 has 0.001, rank 1 has 0.002"),
        ("clip", "'gradient_clipping': rank 0 has 0.0, rank 1 has 1.0"),
    ],
)
def test_ranks_with_different_configs_fail_naming_the_key(kind, expected):
    with pytest.raises(DistributedTestError, match="different configs") as err:
        run_distributed(_different_configs, 2, kind, timeout=60)
    for rank in (0, 1):
        assert f"rank {rank} of 2 raised" in str(err.value)
    assert expected in str(err.value)


def _unused_on_one_rank() -> list[float]:
    torch.manual_seed(0)

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 1)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Rank 1 never uses head b: its gradient there is zero, and must not hang.
            out = self.a(x)
            return out + self.b(x) if dist.get_rank() == 0 else out

    model = TwoHeads()
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"reduce_bucket_size": 1},
    }
    engine, *_ = zerotrain.initialize(model=model, config=config)
    before = model.b.weight.detach().clone()
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    # Averaged over 2 ranks: rank 0's gradient (ones) / 2, applied with lr 1.
    return (before - model.b.weight.detach()).view(-1).tolist()


def test_parameter_unused_on_one_rank_is_averaged_without_hanging():
    for delta in run_distributed(_unused_on_one_rank, 2, timeout=60):
        assert delta == pytest.approx([0.5] * 4)


def _user_zero_grad(stage: int, user_optimizer: bool) -> dict:
    spec = RunSpec(steps=3, grad_accum=2, stage=stage, opt_params=ADAMW)
    model = make_model(spec)
    config = zerotrain_config(spec, 2)
    if user_optimizer:
        del config["optimizer"]
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
        engine, *_ = zerotrain.initialize(model=model, optimizer=opt, config=config)
    else:
        engine, *_ = zerotrain.initialize(model=model, config=config)
    batches = global_batches(spec, 2)
    for step in range(spec.steps):
        model.zero_grad(set_to_none=True)  # a habit of plain PyTorch loops
        if user_optimizer:
            opt.zero_grad(set_to_none=True)
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), 2)
            engine.backward(engine(x, y))
            engine.step()
    return {"losses": [0.0], "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize(
    ("stage", "user_optimizer"), [(0, False), (0, True), (1, False), (2, False)]
)
def test_zero_grad_set_to_none_between_steps_loses_nothing(stage, user_optimizer):
    got = run_distributed(_user_zero_grad, 2, stage, user_optimizer)[0]
    ref = train_reference(RunSpec(steps=3, grad_accum=2, opt_params=ADAMW), 2)
    assert_matches(got, {**ref, "losses": [0.0]})


def _ranks() -> tuple[int, ...]:
    engine, _, _, _ = zerotrain.initialize(
        model=torch.nn.Linear(4, 2), config={"train_batch_size": 2 * dist.get_world_size()}
    )
    return (
        engine.global_rank,
        engine.world_size,
        engine.dp_rank,
        engine.dp_world_size,
        engine.pp_rank,
        engine.tp_rank,
        engine.sp_rank,
    )


def test_rank_accessors_follow_the_grid():
    # Without pipeline/tensor/sequence parallelism the data axis is the whole job.
    assert run_distributed(_ranks, 2) == [(0, 2, 0, 2, 0, 0, 0), (1, 2, 1, 2, 0, 0, 0)]


def _client_and_config_optimizer(with_section: bool) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config: dict = {"train_batch_size": 2, "zero_optimization": {"stage": 1}}
    if with_section:  # DeepSpeed uses the client optimizer and ignores this section
        config["optimizer"] = {"type": "SGD", "params": {"lr": 10.0}}
    engine, _, _, _ = zerotrain.initialize(model=model, config=config, optimizer=client)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(1, 4, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_client_optimizer_wins_over_the_config_section_as_in_deepspeed():
    both = run_distributed(_client_and_config_optimizer, 2, True)
    client_only = run_distributed(_client_and_config_optimizer, 2, False)
    assert both == client_only
