"""Pipeline schedules as data, checked and timed without processes, and compared with
torch.distributed.pipelining's own orders (built from stand-in stages, no process group)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from zerotrain.parallel.pipeline.builders import (
    build_schedule,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)
from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.parallel.pipeline.simulate import ScheduleDeadlockError, simulate
from zerotrain.parallel.pipeline.validate import validate_schedule

T = ActionType
SIZES = [(p, m) for p in (2, 3, 4) for m in sorted({p, 8, 12})]
NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _build(name: str, p: int, m: int) -> PipelineSchedule:
    return build_schedule(name, p, m, 2 if name == "interleaved" else 1)


def _buildable(name: str, p: int, m: int) -> bool:
    return name != "interleaved" or m % p == 0


# Every (schedule, P, M) the builders accept (interleaved needs M % P == 0).
BUILDABLE = [(n, p, m) for n in NAMES for p, m in SIZES if _buildable(n, p, m)]


def _stages(p: int, v: int, rank: int = 0) -> list[Any]:
    """Stand-ins with the attributes torch's schedule constructors read."""
    return [
        SimpleNamespace(
            stage_index=c * p + rank, num_stages=p * v, group_size=p, group_rank=rank, submod=None
        )
        for c in range(v)
    ]


def _torch_order(
    order: dict[int, list[Any]], kinds: tuple[str, ...] = ("F", "B", "I", "W")
) -> list[list[str]]:
    return [
        [str(a) for a in order[r] if a is not None and a.computation_type.value in kinds]
        for r in sorted(order)
    ]


def _ours(schedule: PipelineSchedule) -> list[list[str]]:
    return [[str(a) for a in row] for row in schedule.actions]


# ---- the IR -------------------------------------------------------------------------------


def test_action_strings_match_torch_and_parse_back() -> None:
    for kind, stage, mb in itertools.product(ActionType, (0, 3, 12), (0, 7, 10)):
        action = Action(stage, kind, None if kind is T.REDUCE_GRAD else mb)
        assert Action.parse(str(action)) == action
        kind_there = torch_schedules._ComputationType(kind.value)
        assert str(action) == str(torch_schedules._Action(stage, kind_there, action.microbatch))
    for text in ("1F0", "0B3", "2SEND_F1", "1RECV_B0", "0REDUCE_GRAD"):
        assert str(Action.parse(text)) == text
    assert Action.parse("12I10") == Action(12, T.BACKWARD_INPUT, 10)


@pytest.mark.parametrize("text", ["", "F0", "0X1", "0F", "0REDUCE_GRAD1", "-1F0", "0F0x"])
def test_action_parse_names_text_and_forms(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse pipeline action") as info:
        Action.parse(text)
    assert repr(text) in str(info.value)
    assert "0REDUCE_GRAD" in str(info.value)  # the allowed forms


def test_placement_and_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"wrong rank: stage 1 lives on rank 1"):
        PipelineSchedule("x", 2, 1, 1, ((Action(1, T.FORWARD, 0),), ()))
    with pytest.raises(ValueError, match="one list per rank"):
        PipelineSchedule("x", 2, 1, 1, ((),))
    with pytest.raises(ValueError, match=r"micro-batch outside 0\.\.0"):
        PipelineSchedule("x", 1, 1, 1, ((Action(0, T.FORWARD, 1),),))
    s = interleaved_one_f_one_b(2, 4, 3)
    assert s.num_stages == 6
    assert s.stages_of_rank(1) == (1, 3, 5)
    assert s.stage_to_rank(4) == 0


@pytest.mark.parametrize(("name", "p", "m"), BUILDABLE)
def test_csv_round_trip(name: str, p: int, m: int) -> None:
    for s in (_build(name, p, m), _build(name, p, m).with_communication()):
        back = PipelineSchedule.from_csv(s.to_csv(), name=name)
        assert back == s
    assert str(s).splitlines()[1].startswith("rank 0 | ")


def test_csv_is_torchs_both_ways(tmp_path: Path) -> None:
    theirs = torch_schedules.ScheduleInterleaved1F1B(_stages(4, 2), 8)
    theirs._dump_csv(str(tmp_path / "t.csv"), format="compute_only")  # idle steps: empty fields
    ours = interleaved_one_f_one_b(4, 8, 2)
    with open(tmp_path / "t.csv", newline="") as f:  # keep torch's "\r\n" line ends
        text = f.read()
    assert text.endswith("\r\n")
    assert PipelineSchedule.from_csv(text, name="interleaved") == ours
    for name in ("1f1b", "zb-h1"):
        (tmp_path / "o.csv").write_text(build_schedule(name, 3, 6).to_csv(), newline="")
        loader = torch_schedules._PipelineScheduleRuntime(_stages(3, 1), 6)
        loader._load_csv(str(tmp_path / "o.csv"))  # torch validates it while loading
        assert _torch_order(loader.pipeline_order) == _ours(build_schedule(name, 3, 6))
    with pytest.raises(ValueError, match="rank 1, column 0"):
        PipelineSchedule.from_csv("0F0,0B0\r\nnope\r\n")


# ---- orders equal torch's -----------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_and_1f1b_orders_equal_torch(p: int, m: int) -> None:
    ours = _ours(gpipe(p, m))
    assert _torch_order(torch_schedules.ScheduleGPipe(_stages(p, 1)[0], m).pipeline_order) == ours
    ours = _ours(one_f_one_b(p, m))
    theirs = _torch_order(torch_schedules.Schedule1F1B(_stages(p, 1)[0], m).pipeline_order)
    assert theirs[:-1] == ours[:-1]
    if theirs[-1] != ours[-1]:
        # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards
        # 1..M (it increments before the first use when there is no warm-up); its runtime,
        # _step_microbatches, runs 0..M-1 as we do.
        shifted = [
            str(Action(a.stage, a.kind, a.microbatch + 1) if a.kind is T.FORWARD else a)
            for a in map(Action.parse, ours[-1])
            if a.microbatch is not None
        ]
        assert theirs[-1] == shifted
    # torch's generic 1F1B generator (the one its interleaved schedules use), P-1-r warm-up:
    for r in range(p):
        gen = torch_schedules._get_1f1b_rank_ops(
            1, p, p - 1 - r, m - (p - 1 - r), p - 1 - r, r, lambda _, r=r: r, lambda _, r=r: r
        )
        assert _torch_order({0: gen})[0] == ours[r]


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m % p == 0])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_order_equals_torch(p: int, m: int, v: int) -> None:
    theirs = torch_schedules.ScheduleInterleaved1F1B(_stages(p, v), m)
    ours = interleaved_one_f_one_b(p, m, v)
    assert _torch_order(theirs.pipeline_order) == _ours(ours)
    # Lowered, the compute and reduction order still matches torch's lowering.
    keep = ("F", "B", "REDUCE_GRAD")
    lowered = PipelineSchedule.from_csv(ours.with_communication().to_csv())
    assert _torch_order(theirs.pipeline_order_with_comms, keep) == [
        [str(a) for a in row if a.kind.value in keep] for row in lowered.actions
    ]


@pytest.mark.parametrize(
    ("cls", "v"), [("ScheduleInterleaved1F1B", 2), ("ScheduleInterleavedZeroBubble", 1)]
)
def test_torchs_lowered_schedules_pass_our_checks(cls: str, v: int) -> None:
    theirs = getattr(torch_schedules, cls)(_stages(4, v), 8)
    rows = _torch_order(theirs.pipeline_order_with_comms, tuple(k.value for k in ActionType))
    lowered = PipelineSchedule("torch", 4, 8, v, tuple(tuple(map(Action.parse, r)) for r in rows))
    ours = simulate(build_schedule("interleaved" if v > 1 else "zb-h1", 4, 8, v))
    # Torch posts each receive as soon as the sender sends and waits for it at the compute;
    # read as blocking receives, as here, its order is valid but slower than ours.
    assert simulate(lowered).makespan >= ours.makespan


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_equals_torch_zero_bubble_with_one_stage_per_rank(p: int, m: int) -> None:
    theirs = torch_schedules.ScheduleInterleavedZeroBubble(_stages(p, 1), m)
    assert _torch_order(theirs.pipeline_order) == _ours(zero_bubble_h1(p, m))


# ---- facts checked with the simulator ----------------------------------------------------


@pytest.mark.parametrize(("name", "p", "m"), BUILDABLE)
def test_forward_precedes_backward_and_lowering_keeps_timing(name: str, p: int, m: int) -> None:
    s = _build(name, p, m)
    validate_schedule(s)
    for row in s.actions:
        pos = {a: i for i, a in enumerate(row)}
        for a in row:
            if a.kind in (T.BACKWARD, T.BACKWARD_INPUT):
                assert pos[Action(a.stage, T.FORWARD, a.microbatch)] < pos[a]
            if a.kind is T.BACKWARD_WEIGHT:
                assert pos[Action(a.stage, T.BACKWARD_INPUT, a.microbatch)] < pos[a]
    lowered = s.with_communication()
    assert simulate(lowered).makespan == simulate(s).makespan
    assert simulate(lowered).finish.keys() >= simulate(s).finish.keys()


def test_lowering_places_transfers_next_to_compute() -> None:
    rows = [[str(a) for a in row] for row in one_f_one_b(2, 2).with_communication().actions]
    assert rows == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1",
         "0REDUCE_GRAD"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1",
         "1REDUCE_GRAD"],
    ]  # fmt: skip
    zb = [str(a) for a in zero_bubble_h1(2, 2).with_communication().actions[1]]
    assert zb[-2:] == ["1W1", "1REDUCE_GRAD"]  # reduced after the last W, not the last I
    with pytest.raises(ValueError, match="already has communication"):
        one_f_one_b(2, 2).with_communication().with_communication()


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize("b", [1.0, 2.0])
def test_gpipe_and_1f1b_bubble_and_memory(p: int, m: int, b: float) -> None:
    cost = {T.FORWARD: 1.0, T.BACKWARD: b}
    for s, live in ((gpipe(p, m), [m] * p), (one_f_one_b(p, m), [p - st for st in range(p)])):
        sim = simulate(s, cost)
        assert sim.makespan == (m + p - 1) * (1 + b)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert [sim.peak_live_activations[st] for st in range(p)] == live


def _interleaved_live(p: int, m: int, v: int, stage: int) -> int:
    """The formula in interleaved_one_f_one_b's docstring."""
    chunk, rank = divmod(stage, p)
    x = 2 * (v - 1 - chunk) * p + 2 * (p - 1 - rank) + 1
    return min(m, min(x, p) + min(max(x - v * p, 0), p))


@pytest.mark.parametrize(("p", "m"), [(p, k * p) for p in (1, 2, 3, 4, 5) for k in (1, 2, 3, 4)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_and_memory(p: int, m: int, v: int) -> None:
    s = interleaved_one_f_one_b(p, m, v)
    for f, b in ((1.0, 1.0), (1.0, 2.0), (1.0, 3.0), (2.0, 1.0)):
        sim = simulate(s, {T.FORWARD: f, T.BACKWARD: b})
        assert sim.makespan == (v * m + p - 1) * (f + b)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sim.peak_live_activations == {st: _interleaved_live(p, m, v, st) for st in range(p * v)}
    warmup = [min((v - 1) * p + 2 * (p - 1 - r), v * m) for r in range(p)]
    assert sim.peak_live_per_rank == tuple(min(w + 1, v * m) for w in warmup)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_fills_the_bubble_within_1f1b_memory(p: int, m: int) -> None:
    unit = {T.FORWARD: 1.0, T.BACKWARD_INPUT: 1.0, T.BACKWARD_WEIGHT: 1.0, T.BACKWARD: 2.0}
    zb, base = simulate(zero_bubble_h1(p, m), unit), simulate(one_f_one_b(p, m), unit)
    assert zb.makespan == 3 * m + p - 1  # bubble P-1 per rank, a third of 1F1B's 3(P-1)
    assert base.makespan == 3 * (m + p - 1)
    assert zb.bubble_fraction < base.bubble_fraction
    assert set(zb.peak_live_activations.values()) == {p} == {max(base.peak_live_per_rank)}
    for a, t in zb.start.items():
        if a.kind is T.BACKWARD_WEIGHT:
            assert t >= zb.finish[Action(a.stage, T.BACKWARD_INPUT, a.microbatch)]


def test_per_action_durations_replay_slow_actions() -> None:
    """In 1F1B(2, 4) a slow first forward delays the whole step by its extra time, while
    the same delay on 0F1, which has slack (rank 1 is busy with 1B0 until it needs 0F1's
    output), costs nothing; the other actions keep the kind costs."""
    s = one_f_one_b(2, 4)
    base = simulate(s)
    first = simulate(s, durations={Action(0, T.FORWARD, 0): 1.5})
    assert first.makespan == base.makespan + 0.5
    assert first.start[Action(1, T.FORWARD, 0)] == base.start[Action(1, T.FORWARD, 0)] + 0.5
    assert first.busy == (base.busy[0] + 0.5, base.busy[1])
    slack = simulate(s, durations={Action(0, T.FORWARD, 1): 1.5})
    assert slack.makespan == base.makespan
    with pytest.raises(ValueError, match="duration of 0F1 must be finite"):
        simulate(s, durations={Action(0, T.FORWARD, 1): float("nan")})
    with pytest.raises(ValueError, match="durations name actions the schedule lacks: 0F9"):
        simulate(s, durations={Action(0, T.FORWARD, 9): 1.0})


# ---- errors ------------------------------------------------------------------------------


def _parse_rows(*rows: str) -> PipelineSchedule:
    return PipelineSchedule.from_csv("\r\n".join(rows) + "\r\n", name="broken")


def test_deadlock_is_reported_with_what_each_rank_waits_for() -> None:
    crossed = _parse_rows("0F0,0B0,0F1,0B1", "1F1,1B1,1F0,1B0")
    with pytest.raises(ScheduleDeadlockError) as info:
        simulate(crossed)
    text = str(info.value)
    assert "rank 0 blocked at position 1 on 0B0, waiting for 1B0 (rank 1, position 3" in text
    assert "rank 1 blocked at position 0 on 1F1, waiting for 0F1 (rank 0, position 2" in text
    # Each rank waits to receive before it sends what the other waits for.
    recv_first = _parse_rows("0F0,0RECV_B0,0SEND_F0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0")
    with pytest.raises(ScheduleDeadlockError) as info:
        simulate(recv_first)
    assert "rank 0 blocked at position 1 on 0RECV_B0, waiting for 1SEND_B0" in str(info.value)
    assert "rank 1 blocked at position 0 on 1RECV_F0, waiting for 0SEND_F0" in str(info.value)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (("0F0,0F1,0B0", "1F0,1F1,1B0,1B1"), "no backward 0B1"),
        (("0B0,0F0", "1F0,1B0"), r"0B0 \(rank 0, position 0\) comes before 0F0"),
        (("0F0,0F0,0B0", "1F0,1B0"), "repeats the action"),
        (("0F0,0I0,0B0", "1F0,1B0"), "either one B or one I and one W"),
        (("0F0,0W0,0I0", "1F0,1B0"), "W follows the I"),
        (("0F0,0SEND_F0,0RECV_B0,0B0", "1F0,1B0,1SEND_B0"), "1RECV_F0 is missing"),
        (("0F0,0SEND_F0,0SEND_F0", "1RECV_F0,1F0"), "repeats the action"),
        (("0SEND_F0,0F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"), "0SEND_F0 .* before 0F0"),
        (("0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1SEND_F0,1B0,1SEND_B0"), "1SEND_F0 .* no "),
        (("0F0,0B0,0REDUCE_GRAD", "1F0,1B0"), "not 1"),
    ],
)
def test_invalid_schedules_name_the_action(rows: tuple[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(_parse_rows(*rows))


def test_builder_limits() -> None:
    with pytest.raises(ValueError, match="at least as many micro-batches as stages") as info:
        one_f_one_b(4, 3)
    assert "got 3 micro-batches for 4 stages" in str(info.value)
    assert "gpipe" in str(info.value)
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        build_schedule("interleaved_1f1b", 2, 4)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_schedule("gpipe", 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved, zb-h1, interleaved_1f1b, zbh1"):
        build_schedule("pipedream", 2, 4)
    assert build_schedule("ZBH1", 2, 2) == zero_bubble_h1(2, 2)
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="cost of BACKWARD must be finite"):
        simulate(gpipe(2, 2), {T.BACKWARD: -1.0})
