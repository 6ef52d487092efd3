"""The pipeline's communication plan against NCCL's matching rules (issue 41).

NCCL matches the messages of a pair of ranks by posting order and runs a rank's groups in
order; ``nccl_rules.check_nccl_order`` replays each rank's posts and waits under those
rules, with no buffering of sends (messages above NCCL's ~4 MB eager limit: below it a send
may finish before its receive is posted, which only hides a bad order). Property: for every
schedule the builders make, P=2..6, several v and M, training and evaluation steps, with
shape descriptions on no step, on the first step (micro-batch 0), on a step whose inputs
change shape midway, and on every micro-batch, the plan mirrors per pair and the replay
finds neither a deadlock nor a mismatch. A deliberately mis-ordered plan, and the posting
order the executor had before the plan (the lowered schedule's order, one op at a time),
are caught.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tests.helpers.plans import delay_activation_send
from zerotrain.parallel.pipeline.builders import build_schedule
from zerotrain.parallel.pipeline.messages import Channel
from zerotrain.parallel.pipeline.nccl_rules import (
    Event,
    NcclOrderError,
    Op,
    Post,
    Wait,
    check_nccl_order,
    host_programs,
)
from zerotrain.parallel.pipeline.plan import (
    CommPlan,
    Exchange,
    Message,
    PlanItem,
    build_plan,
    message_of,
)
from zerotrain.parallel.pipeline.schedule import ActionType, PipelineSchedule


def _schedules() -> list[PipelineSchedule]:
    found = []
    for name, virtual in [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + [
        ("interleaved", v) for v in (2, 3, 4)
    ]:
        for ranks in range(2, 7):
            for micro in sorted({ranks, ranks + 1, 2 * ranks, 2 * ranks + 1, 8}):
                try:
                    schedule = build_schedule(name, ranks, micro, virtual)
                except ValueError:
                    continue  # the builder's own limits (interleaved: M a multiple of P)
                found.append(schedule.with_communication())
    return found


SCHEDULES = _schedules()


def _descriptions(schedule: PipelineSchedule) -> dict[str, frozenset[Message]]:
    """Which activation messages carry a shape description, per kind of step."""
    stages, micro = schedule.num_stages, schedule.num_microbatches
    half = micro // 2

    def at(micros: list[int]) -> frozenset[Message]:
        return frozenset(
            Message(Channel.ACTIVATIONS, s, m) for s in range(stages - 1) for m in micros
        )

    return {
        "steady": at([]),
        "first": at([0]),
        "shape change": at([half]),
        "first and shape change": at([0, half]),
        "every micro-batch": at(list(range(micro))),
    }


def _pair_batches(plan: CommPlan) -> dict[tuple[int, int], list[frozenset[tuple[int, Message]]]]:
    """For each ordered pair (a, b): a's exchanges that involve b, in order, each as the set
    of (sending rank, message) it moves between them."""
    seqs: dict[tuple[int, int], list[frozenset[tuple[int, Message]]]] = {}
    for rank in range(plan.schedule.num_ranks):
        for exchange in plan.exchanges(rank):
            by_peer: dict[int, set[tuple[int, Message]]] = {}
            for t in exchange.transfers:
                sender = rank if t.kind == "send" else t.peer
                by_peer.setdefault(t.peer, set()).add((sender, t.message))
            for peer, moved in by_peer.items():
                seqs.setdefault((rank, peer), []).append(frozenset(moved))
    return seqs


def _direction(plan: CommPlan, rank: int, kind: str, peer: int) -> list[Message]:
    return [t.message for e in plan.exchanges(rank) for t in e.transfers
            if t.kind == kind and t.peer == peer]  # fmt: skip


def test_the_property_covers_every_builder():
    names = {s.name for s in SCHEDULES}
    assert names == {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b"} or len(names) == 4, names
    assert {s.virtual_stages for s in SCHEDULES} == {1, 2, 3, 4}
    assert {s.num_ranks for s in SCHEDULES} == set(range(2, 7))
    assert len(SCHEDULES) > 80


@pytest.mark.parametrize(
    "schedule",
    SCHEDULES,
    ids=lambda s: f"{s.name}-P{s.num_ranks}-v{s.virtual_stages}-M{s.num_microbatches}",
)
def test_plans_mirror_per_pair_and_pass_nccl_rules(schedule):
    for forward_only in (False, True):
        plan = build_plan(schedule, forward_only)
        batches = _pair_batches(plan)
        for (a, b), mine in batches.items():
            # a's k-th batch involving b mirrors b's k-th batch involving a ...
            assert mine == batches.get((b, a)), f"ranks {a} and {b}: batches differ"
            # ... and within batches, a's sends to b come in the order b receives them.
            assert _direction(plan, a, "send", b) == _direction(plan, b, "recv", a)
        # Every transfer of the schedule is in the plan exactly once.
        moved = [
            message_of(a)
            for row in schedule.actions
            for a in row
            if a.kind in (ActionType.SEND_F, ActionType.RECV_F)
            or (not forward_only and a.kind in (ActionType.SEND_B, ActionType.RECV_B))
        ]
        planned = [t.message for r in range(schedule.num_ranks) for e in plan.exchanges(r)
                   for t in e.transfers]  # fmt: skip
        assert sorted(moved) == sorted(planned)
        for step, described in _descriptions(schedule).items():
            try:
                check_nccl_order(host_programs(plan, described))
            except NcclOrderError as err:
                pytest.fail(f"{step} step, forward_only={forward_only}: {err}")


def test_a_mis_ordered_plan_is_caught_naming_both_ranks_and_messages():
    plan = build_plan(build_schedule("1f1b", 2, 4).with_communication())
    bad = delay_activation_send(plan, 0, 1)  # rank 0 sends F2 before F1
    with pytest.raises(NcclOrderError) as caught:
        check_nccl_order(host_programs(bad))
    text = str(caught.value)
    assert "mismatch" in text, text
    assert "rank 0" in text, text
    assert "rank 1" in text, text
    assert "micro-batch 1" in text, text
    assert "micro-batch 2" in text, text


def _naive_programs(schedule: PipelineSchedule) -> list[list[Event]]:
    """What the executor did before the plan: each transfer posted alone where the lowered
    schedule has it, a receive waited for right there, every send at the end."""
    programs = []
    for row in schedule.actions:
        events: list[Event] = []
        sends: list[Op] = []
        for action in row:
            if action.kind not in (ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B,
                                   ActionType.RECV_B):  # fmt: skip
                continue
            message = message_of(action)
            sending = action.kind in (ActionType.SEND_F, ActionType.SEND_B)
            step = 1 if action.kind in (ActionType.SEND_F, ActionType.RECV_B) else -1
            op = Op("send" if sending else "recv", schedule.stage_to_rank(action.stage + step),
                    str(message))  # fmt: skip
            events.append(Post((op,)))
            if sending:
                sends.append(op)
            else:
                events.append(Wait(op))
        programs.append(events + [Wait(op) for op in sends])
    return programs


def test_the_old_one_at_a_time_order_deadlocks_plain_1f1b():
    schedule = build_schedule("1f1b", 2, 4).with_communication()
    with pytest.raises(NcclOrderError, match="deadlock") as caught:
        check_nccl_order(_naive_programs(schedule))
    assert "rank 0" in str(caught.value)
    assert "rank 1" in str(caught.value)
    check_nccl_order(host_programs(build_plan(schedule)))  # the plan of the same schedule


def test_a_wait_for_something_never_posted_is_named():
    programs: list[list[Event]] = [[Wait(Op("recv", 1, "x"))], []]
    with pytest.raises(NcclOrderError, match="never posted"):
        check_nccl_order(programs)


def test_a_receive_nobody_sends_is_a_deadlock_naming_the_rank():
    programs: list[list[Event]] = [[Post((Op("recv", 1, "x"),)), Wait(Op("recv", 1, "x"))], []]
    with pytest.raises(NcclOrderError, match="rank 0 waits for recv of x"):
        check_nccl_order(programs)


def test_one_group_completes_crossing_sends_that_separate_groups_would_deadlock():
    a_to_b, b_to_a = Op("send", 1, "a"), Op("send", 0, "b")
    from_b, from_a = Op("recv", 1, "b"), Op("recv", 0, "a")
    together: list[list[Event]] = [
        [Post((a_to_b, from_b)), Wait(from_b)],
        [Post((b_to_a, from_a)), Wait(from_a)],
    ]
    check_nccl_order(together)
    apart: list[list[Event]] = [
        [Post((a_to_b,)), Post((from_b,)), Wait(from_b)],
        [Post((b_to_a,)), Post((from_a,)), Wait(from_a)],
    ]
    with pytest.raises(NcclOrderError, match="deadlock"):
        check_nccl_order(apart)


def test_plans_are_cached_per_schedule():
    schedule = build_schedule("1f1b", 3, 6).with_communication()
    assert build_plan(schedule) is build_plan(schedule)
    assert build_plan(schedule, True) is not build_plan(schedule)


def test_exchanges_post_sends_first_and_keep_every_action():
    schedule = build_schedule("interleaved", 2, 4, 2).with_communication()
    plan = build_plan(schedule)
    for rank, row in enumerate(schedule.actions):
        compute = [a for a in row if a.kind in (ActionType.FORWARD, ActionType.BACKWARD,
                                               ActionType.REDUCE_GRAD)]  # fmt: skip
        assert [i for i in plan.items[rank] if not isinstance(i, Exchange)] == compute
        for exchange in plan.exchanges(rank):
            kinds = [t.kind for t in exchange.transfers]
            assert kinds == sorted(kinds, key=lambda k: k != "send")
    assert any(len(e.transfers) > 1 for r in range(2) for e in plan.exchanges(r)), (
        "1F1B's steady state sends and receives together"
    )


def test_itertools_product_of_descriptions_is_not_needed():
    """Descriptions ride in the exchange of their data, so which messages carry one never
    changes the order of data messages: checked here on one schedule for every subset of
    its first stage's micro-batches."""
    schedule = build_schedule("1f1b", 3, 4).with_communication()
    plan = build_plan(schedule)
    for r in range(5):
        for micros in itertools.combinations(range(4), r):
            described = frozenset(Message(Channel.ACTIVATIONS, s, m) for s in (0, 1)
                                  for m in micros)  # fmt: skip
            check_nccl_order(host_programs(plan, described))


def test_an_exchange_split_into_one_group_per_message_deadlocks_1f1b():
    """Why an exchange is one batch: 1F1B's steady state sends activations forward while
    the next stage sends gradients back; posted as separate groups, each rank's stream
    stops at its send, whose receive sits behind the peer's own send."""
    schedule = build_schedule("1f1b", 2, 4).with_communication()
    plan = build_plan(schedule)
    rows = []
    for items in plan.items:
        split: list[PlanItem] = []
        for item in items:
            if isinstance(item, Exchange):
                split += [Exchange(item.time, (t,)) for t in item.transfers]
            else:
                split.append(item)
        rows.append(tuple(split))
    with pytest.raises(NcclOrderError, match="deadlock"):
        check_nccl_order(host_programs(dataclasses.replace(plan, items=tuple(rows))))


def test_operations_left_unmatched_at_the_end_are_named():
    """Every wait returned, yet an extra receive (or send) stays posted: on NCCL it would
    meet the next step's messages or hang it (found in review)."""
    x, y = Op("send", 1, "x"), Op("recv", 0, "x")
    extra: list[list[Event]] = [
        [Post((x,)), Wait(x)],
        [Post((y, Op("recv", 0, "y"))), Wait(y)],
    ]
    with pytest.raises(NcclOrderError, match=r"never matched.*recv of y from rank 0"):
        check_nccl_order(extra)
    check_nccl_order([[Post((x,)), Wait(x)], [Post((y,)), Wait(y)]])
