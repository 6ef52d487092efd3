"""ZeRO stage 0 (plain data parallelism): parity with single-process training, communication
accounting, overlap with backward, and clear errors for misuse."""

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
    train_zerotrain,
    zerotrain_config,
)
from zerotrain.testing.dist import DistributedTestError, run_distributed

# eps 1e-6: with 1e-8, an element whose gradient cancels to ~1e-9 moves by about
# lr * rounding noise / eps, so Adam would amplify reduction-order noise past 1e-5.
OPTIMIZERS = {
    "Adam": {"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-6},
    "AdamW": {"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-6},
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "Lamb": {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-6},
}


def _spec(optimizer: str, **overrides) -> RunSpec:
    base = {"two_groups": True, "freeze": "blocks.0.ln1.weight"}
    return RunSpec(optimizer=optimizer, opt_params=OPTIMIZERS[optimizer], **{**base, **overrides})


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_single_process_training(optimizer, world_size):
    """20 steps, accumulation 2, clipping 1.0, two param groups and a frozen parameter."""
    spec = _spec(optimizer)
    results = run_distributed(train_zerotrain, world_size, spec)
    reference = train_reference(spec, world_size)
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it actually trained
    for result in results:
        assert_matches(result, reference)
    frozen = spec.freeze
    assert torch.equal(results[0]["params"][frozen], make_model(spec).state_dict()[frozen])


@pytest.mark.slow
def test_matches_single_process_training_on_four_ranks():
    spec = _spec("Adam")
    results = run_distributed(train_zerotrain, 4, spec)
    assert_matches(results[0], train_reference(spec, 4))


@pytest.mark.parametrize(
    "extra",
    [
        {"prescale_gradients": True},
        {"gradient_predivide_factor": 2.0},
        {"zero_optimization": {"stage": 0, "overlap_comm": False, "reduce_bucket_size": 4000}},
        {"zero_optimization": {"stage": 0, "reduce_bucket_size": 0}},
    ],
    ids=["prescale", "predivide", "no-overlap", "bucket-per-tensor"],
)
def test_reduction_options_do_not_change_the_result(extra):
    spec = _spec("AdamW", extra_config=extra, steps=8)
    results = run_distributed(train_zerotrain, 2, spec)
    assert_matches(results[0], train_reference(spec, 2))


# -- user-supplied optimizer and scheduler --------------------------------------------------


def _train_user_optimizer(kind: str, steps: int) -> list[float]:
    spec = RunSpec(steps=steps)
    model = make_model(spec)
    world = dist.get_world_size()
    config = {k: v for k, v in zerotrain_config(spec, world).items() if k != "optimizer"}
    if kind == "object":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, eps=1e-6)
        engine, returned, _, sched = zerotrain.initialize(model=model, optimizer=opt, config=config)
        assert returned is opt
    else:
        engine, returned, _, sched = zerotrain.initialize(
            model=model,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
            config=config,
        )
        assert isinstance(returned, torch.optim.SGD) and sched is not None
    batches = global_batches(spec, world)
    for step in range(steps):
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), world)
            engine.backward(engine(x, y))
            engine.step()
    return [float(p.detach().sum()) for p in model.parameters()] + engine.get_lr()


def test_user_optimizer_object_matches_reference():
    steps = 6
    got = run_distributed(_train_user_optimizer, 2, "object", steps)[0]
    spec = RunSpec(steps=steps, opt_params={"lr": 3e-3, "weight_decay": 0.01, "eps": 1e-6})
    ref = train_reference(spec, 2)
    ref_sums = [float(p.sum()) for p in ref["params"].values()]
    assert got[:-1] == pytest.approx(ref_sums, abs=1e-4)


def test_user_optimizer_callable_and_scheduler_callable():
    got = run_distributed(_train_user_optimizer, 2, "callable", 6)[0]
    assert got[-1] == pytest.approx(0.1 * 0.5**2)  # StepLR after 6 optimizer steps


# -- communication --------------------------------------------------------------------------


def _comm_per_micro_step() -> dict[str, object]:
    spec = RunSpec(steps=2, grad_accum=3)
    model = make_model(spec)
    world = dist.get_world_size()
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, world))
    batches = global_batches(spec, world)
    per_micro = []
    for step in range(spec.steps):
        for micro in range(spec.grad_accum):
            engine.reset_comm_stats()
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), world)
            engine.backward(engine(x, y))
            engine.step()
            snap = engine.comm_stats()
            per_micro.append(
                (
                    snap.total.calls,
                    snap.get("all_reduce", "gradients").bytes,
                    snap.get("all_reduce", "gradients").calls,
                )
            )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"per_micro": per_micro, "grad_bytes": 4 * trainable, "units": len(engine.units)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_one_all_reduce_of_all_gradients_per_step_and_nothing_in_between(world_size):
    for out in run_distributed(_comm_per_micro_step, world_size):
        assert out["units"] > 1  # reduce_bucket_size 4000 splits the model into buckets
        for micro, (calls, grad_bytes, grad_calls) in enumerate(out["per_micro"]):
            if micro % 3 == 2:  # accumulation boundary
                # The paper's volume of one all-reduce of every gradient: 2 x gradient bytes.
                assert grad_bytes == 2 * out["grad_bytes"]
                assert grad_calls == out["units"] and calls == grad_calls
            else:
                assert calls == 0 and grad_bytes == 0


def _launches_during_backward() -> tuple[int, int]:
    spec = RunSpec(steps=1, grad_accum=1)
    model = make_model(spec)
    world = dist.get_world_size()
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, world))
    seen: list[int] = []
    # The embedding's output gradient is among the last things backward computes.
    model.wte.register_full_backward_hook(
        lambda *_: seen.append(engine.comm_stats().get("all_reduce", "gradients").calls)
    )
    engine.reset_comm_stats()
    x, y = micro_batch(global_batches(spec, world), spec, 0, 0, dist.get_rank(), world)
    engine.backward(engine(x, y))
    return seen[0], len(engine.units)


def test_buckets_are_reduced_while_backward_is_still_running():
    launched_before_end, units = run_distributed(_launches_during_backward, 2)[0]
    assert 0 < launched_before_end < units


# -- data, memory, misuse -------------------------------------------------------------------


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
    assert loader is not None and len(loader) == 3
    return [[int(i) for batch in loader for i in batch.view(-1)] for _ in range(2)]


def test_training_data_is_split_across_ranks_and_reshuffled_each_epoch():
    per_rank = run_distributed(_epochs_seen, 2)
    for epoch in range(2):
        seen = per_rank[0][epoch] + per_rank[1][epoch]
        assert sorted(seen) == list(range(24))  # disjoint, complete
    assert per_rank[0][0] != per_rank[0][1]


def _memory() -> dict[str, int]:
    spec = RunSpec(steps=1, grad_accum=1)
    model = make_model(spec)
    model.register_buffer("scale", torch.ones(10))
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    engine.backward(engine(x, y))
    engine.step()
    return {**engine.memory_breakdown().as_dict(), "P": model.num_parameters(),
            "units": len(engine.units)}


def test_memory_breakdown_matches_replicated_fp32_adam():
    out = run_distributed(_memory, 2)[0]
    p = out["P"]
    assert out["params"] == 4 * p and out["grads"] == 4 * p
    # Two fp32 moments per element plus one 4-byte step counter per flat tensor.
    assert out["optimizer_states"] == 8 * p + 4 * out["units"]
    assert out["master_weights"] == 0 and out["buffers"] == 40
    assert out["total"] == sum(v for k, v in out.items() if k not in ("total", "P", "units"))


def _misuse(case: str) -> str:
    spec = RunSpec(steps=1, grad_accum=1)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    try:
        if case == "step-without-backward":
            engine.step()
        elif case == "backward-twice":
            engine.backward(engine(x, y))
            engine.backward(engine(x, y))
        elif case == "plain-loss-backward":
            engine(x, y).backward()
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
        ("step-without-backward", "step() called without engine.backward(loss)"),
        ("backward-twice", "backward() called twice without step()"),
        ("plain-loss-backward", "calling loss.backward() directly bypasses gradient averaging"),
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
    with pytest.raises(DistributedTestError, match="the ranks built different models"):
        run_distributed(_different_models, 2, timeout=60)


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
    engine, *_ = zerotrain.initialize(
        model=model,
        config={"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                "zero_optimization": {"reduce_bucket_size": 1}},
    )
    before = model.b.weight.detach().clone()
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    # Averaged over 2 ranks: rank 0's gradient (ones) / 2, applied with lr 1.
    return (before - model.b.weight.detach()).view(-1).tolist()


def test_parameter_unused_on_one_rank_is_averaged_without_hanging():
    for delta in run_distributed(_unused_on_one_rank, 2, timeout=60):
        assert delta == pytest.approx([0.5] * 4)


def _zero_grad_set_to_none() -> float:
    spec = RunSpec(steps=3, grad_accum=2)
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 2))
    batches = global_batches(spec, 2)
    for step in range(spec.steps):
        model.zero_grad(set_to_none=True)  # a habit of plain PyTorch loops
        for micro in range(spec.grad_accum):
            x, y = micro_batch(batches, spec, step, micro, dist.get_rank(), 2)
            engine.backward(engine(x, y))
            engine.step()
    return float(sum(p.detach().sum() for p in model.parameters()))


def test_model_zero_grad_does_not_lose_gradients():
    spec = RunSpec(steps=3, grad_accum=2)
    got = run_distributed(_zero_grad_set_to_none, 2)[0]
    ref = train_reference(spec, 2)
    assert got == pytest.approx(float(sum(p.sum() for p in ref["params"].values())), abs=1e-4)

