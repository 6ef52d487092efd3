"""What the executor really posts, replayed under NCCL's rules, and a mis-ordered plan
caught by the order-mode header check (issue 41).

Each rank records every point-to-point batch its pipeline posts and every wait, over real
training and evaluation steps of the demo GPT: the first step (shape descriptions), a
steady one (none), and one whose micro-batches change sequence length midway (a
description in the middle). The test process replays the ranks' recordings together with
``nccl_rules.check_nccl_order``, as if their messages were too large for NCCL to buffer.
Recording keeps every send in flight until the step's end (its ``done()`` says False), as
a send on a GPU may stay.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.pipeline import PIPE_GPT, PipeRun, pipeline_module
from tests.helpers.plans import delay_activation_send
from zerotrain.comm.handle import CollectiveError
from zerotrain.parallel.pipeline import executor as executor_module
from zerotrain.parallel.pipeline.nccl_rules import Event, Op, Post, Wait, check_nccl_order
from zerotrain.parallel.pipeline.plan import build_plan
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed

MICRO = 4


class _RecordedHandle:
    """A posted op's handle that writes down each wait, and never reports an early finish
    (so the executor waits for its sends where NCCL could make it wait)."""

    def __init__(self, handle: Any, op: Op, events: list[Event]) -> None:
        self._handle, self._op, self._events = handle, op, events

    def done(self) -> bool:
        return False

    def wait(self) -> Any:
        self._events.append(Wait(self._op))
        return self._handle.wait()


def _record(engine: Any) -> list[Event]:
    """Record what ``engine``'s pipeline posts and waits for, into the returned list."""
    comm = engine.executor.comm
    post = comm.post_in_order
    events: list[Event] = []
    seen: Counter[tuple[str, int, str]] = Counter()

    def recording_post(ops: Any) -> Any:
        named = []
        for op in ops:
            what = op.entry()
            seen[(op.kind, op.peer, what)] += 1  # tensors of one message alike: numbered
            named.append(Op(op.kind, op.peer, f"{what} #{seen[(op.kind, op.peer, what)]}"))
        events.append(Post(tuple(named)))
        return [_RecordedHandle(h, o, events) for h, o in zip(post(ops), named, strict=True)]

    comm.post_in_order = recording_post  # this engine's communicator only
    return events


def _tokens(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, PIPE_GPT.vocab_size, (2, length + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _recorded_steps(stages: int, schedule: str, virtual: int, zero: int) -> dict[str, Any]:
    run = PipeRun(stages, schedule, virtual, zero_stage=zero, micro_batches=MICRO)
    engine, *_ = zerotrain.initialize(
        model=pipeline_module(stages, virtual), config=run.config(dist.get_world_size() // stages)
    )
    events = _record(engine)
    steps: dict[str, list[Event]] = {}
    lengths = {
        "first": [16] * MICRO,
        "steady": [16] * MICRO,
        "shape change": [16, 16, 8, 8],
        "evaluation": [12] * MICRO,  # a length not seen before
    }
    for i, (name, per_micro) in enumerate(lengths.items()):
        batches = [_tokens(10 * i + m, n) for m, n in enumerate(per_micro)]
        if name == "evaluation":
            engine.eval_batch(iter(batches))
        else:
            engine.train_batch(iter(batches))
        steps[name] = list(events)
        events.clear()
    return {"pipe_rank": engine.groups.pipe.rank, "steps": steps}


CASES = [
    ("1f1b", 2, 1, 1),
    ("1f1b", 4, 1, 3),
    ("gpipe", 3, 1, 2),
    ("interleaved", 2, 2, 1),
    ("interleaved", 4, 2, 0),
]


@pytest.mark.parametrize(("schedule", "stages", "virtual", "zero"), CASES)
def test_the_executor_posts_in_an_order_nccl_completes(schedule, stages, virtual, zero):
    results = run_distributed(_recorded_steps, stages, stages, schedule, virtual, zero, timeout=120)
    by_rank = sorted(results, key=lambda r: r["pipe_rank"])
    for step in ("first", "steady", "shape change", "evaluation"):
        programs = [r["steps"][step] for r in by_rank]
        described = [
            op.what for p in programs for e in p if isinstance(e, Post) for op in e.ops
            if op.what.startswith("stage_shapes")
        ]  # fmt: skip
        posts = sum(isinstance(e, Post) for p in programs for e in p)
        assert posts > 0, step
        # Descriptions move exactly when shapes are new to the pipeline.
        assert bool(described) == (step != "steady"), (step, described)
        check_nccl_order(programs)


def _misordered_plan_step() -> str:
    original = executor_module.build_plan

    def delayed(schedule: Any, forward_only: bool = False) -> Any:
        plan = original(schedule, forward_only)
        return plan if forward_only else delay_activation_send(plan, 0, 1)

    executor_module.build_plan = delayed  # this process's executor only
    try:
        run = PipeRun(2, "1f1b", micro_batches=MICRO)
        engine, *_ = zerotrain.initialize(model=pipeline_module(2), config=run.config(1))
        batches = [_tokens(m, 16) for m in range(MICRO)]
        try:
            engine.train_batch(iter(batches))
        except CollectiveError as err:
            return str(err)
        except Exception as err:  # the other rank's own view of the failure
            return f"{type(err).__name__}: {err}"
        return "no error"
    finally:
        executor_module.build_plan = original


def test_a_mis_ordered_plan_fails_on_the_header_check_naming_both_ranks_and_messages():
    assert build_plan is executor_module.build_plan
    results = run_distributed(
        _misordered_plan_step, 2, timeout=90, comm_timeout=10, own_processes=BREAKS_THE_GROUP
    )
    receiver = results[1]
    assert "rank 1" in receiver, receiver
    assert "rank 0" in receiver, receiver
    assert "[stage 0 F1]" in receiver, receiver  # what rank 1 expected
    assert "[stage 0 F2]" in receiver, receiver  # what rank 0 sent instead
    assert "different orders" in receiver, receiver
