"""Static checks of a schedule: complete, ordered, and (with communication) matched.

What is checked here holds regardless of timing, so ``simulate`` only has to find whether
the ranks can make progress (deadlock) and when each action runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule

_F, _B = ActionType.FORWARD, ActionType.BACKWARD
_I, _W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
_SEND_F, _RECV_F = ActionType.SEND_F, ActionType.RECV_F
_SEND_B, _RECV_B = ActionType.SEND_B, ActionType.RECV_B
_REDUCE_GRAD = ActionType.REDUCE_GRAD

Location = tuple[int, int]  # (rank, position in its list)


def validate_schedule(schedule: PipelineSchedule) -> dict[Action, Location]:
    """Check ``schedule`` and return where each action is.

    Every (stage, micro-batch) has exactly one F and either one B or one I and one W, in
    that order in its rank's list (all on the rank owning the stage, which construction
    already checked). If the schedule has any transfer, every transfer between ranks has
    one SEND and one RECV: a send after the compute producing its data, a receive before the
    compute consuming it. If it has any REDUCE_GRAD, each stage has one, after the stage's
    last backward.

    Returns:
        Each action's (rank, position).

    Raises:
        ValueError: the first broken rule, naming the offending action and its location.
    """
    where: dict[Action, Location] = {}
    for rank, row in enumerate(schedule.actions):
        for pos, action in enumerate(row):
            if action in where:
                raise ValueError(
                    f"{_at(action, (rank, pos))} repeats the action at {_loc(where[action])}; "
                    "each action runs once per step"
                )
            where[action] = (rank, pos)
    _check_compute(schedule, where)
    if any(a.is_comm for a in where):
        _check_transfers(schedule, where)
    if any(a.kind is _REDUCE_GRAD for a in where):
        _check_reductions(schedule, where)
    return where


def needs_transfer(schedule: PipelineSchedule, action: Action) -> ActionType | None:
    """The receive a compute action waits for, or None when its input is local (first
    stage's forward, last stage's backward, or an adjacent stage on the same rank)."""
    s, rank = action.stage, schedule.stage_to_rank(action.stage)
    if action.kind is _F and s > 0 and schedule.stage_to_rank(s - 1) != rank:
        return _RECV_F
    last = schedule.num_stages - 1
    if action.kind in (_B, _I) and s < last and schedule.stage_to_rank(s + 1) != rank:
        return _RECV_B
    return None


def _check_compute(schedule: PipelineSchedule, where: Mapping[Action, Location]) -> None:
    for s in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            fwd, full = Action(s, _F, m), Action(s, _B, m)
            inp, wgt = Action(s, _I, m), Action(s, _W, m)
            if fwd not in where:
                raise ValueError(f"{_name(schedule)} has no forward {fwd} (stage {s}, mb {m})")
            split = inp in where or wgt in where
            if full in where and split:
                raise ValueError(
                    f"{_at(full, where[full])} is a full backward, but {inp}/{wgt} also run; "
                    "a micro-batch's backward is either one B or one I and one W"
                )
            if not split and full not in where:
                raise ValueError(f"{_name(schedule)} has no backward {full} (or {inp} and {wgt})")
            if split and (inp not in where or wgt not in where):
                missing = inp if inp not in where else wgt
                raise ValueError(
                    f"{_name(schedule)} splits the backward of stage {s}, micro-batch {m} "
                    f"but has no {missing}"
                )
            first_back = inp if split else full
            _before(fwd, first_back, where, "a backward needs its forward's activations")
            if split:
                _before(inp, wgt, where, "W follows the I of the same micro-batch")


def _check_transfers(schedule: PipelineSchedule, where: Mapping[Action, Location]) -> None:
    expected: set[Action] = set()
    for action in [a for a in where if a.is_compute]:
        recv = needs_transfer(schedule, action)
        if recv is None:
            continue
        s, m = action.stage, action.microbatch
        sender = s - 1 if recv is _RECV_F else s + 1
        send = Action(sender, _SEND_F if recv is _RECV_F else _SEND_B, m)
        receive = Action(s, recv, m)
        expected.update((send, receive))
        producer = next(p for p in _producers(sender, recv is _RECV_F, m) if p in where)
        for needed in (send, receive):
            if needed not in where:
                raise ValueError(
                    f"{_at(action, where[action])} needs {receive} matching {send}, but "
                    f"{needed} is missing; every transfer between ranks has one send and one "
                    "receive"
                )
        _before(producer, send, where, "a send carries what its compute produced")
        _before(receive, action, where, "a compute waits for its receive")
    for action in where:
        if action.is_comm and action not in expected:
            raise ValueError(
                f"{_at(action, where[action])} is a transfer no compute action needs "
                "(no matching compute across ranks); each send has exactly one receive"
            )


def _check_reductions(schedule: PipelineSchedule, where: Mapping[Action, Location]) -> None:
    for s in range(schedule.num_stages):
        reduce = Action(s, _REDUCE_GRAD, None)
        if reduce not in where:
            raise ValueError(f"{_name(schedule)} reduces some stages' gradients but not {s}")
        for m in range(schedule.num_microbatches):
            last = Action(s, _W, m) if Action(s, _W, m) in where else Action(s, _B, m)
            _before(last, reduce, where, "gradients are reduced after the last backward")


def _producers(stage: int, forward: bool, microbatch: int | None) -> tuple[Action, ...]:
    if forward:
        return (Action(stage, _F, microbatch),)
    return (Action(stage, _B, microbatch), Action(stage, _I, microbatch))


def _before(first: Action, then: Action, where: Mapping[Action, Location], why: str) -> None:
    if where[first][1] >= where[then][1]:
        raise ValueError(
            f"{_at(then, where[then])} comes before {first} (position {where[first][1]}); {why}"
        )


def _at(action: Action, location: Location) -> str:
    return f"action {action} ({_loc(location)})"


def _loc(location: Location) -> str:
    return f"rank {location[0]}, position {location[1]}"


def _name(schedule: PipelineSchedule) -> str:
    return f"schedule {schedule.name!r}"
