"""Time a schedule with per-kind unit costs, in one process.

Each rank runs its actions strictly in list order. An action starts when its rank is free
and everything it depends on has finished:

- F(s, m) needs F(s-1, m);
- B(s, m) or I(s, m) needs F(s, m) and the input gradient from stage s+1 (its B or I);
- W(s, m) needs I(s, m);
- RECV_F(s, m) needs SEND_F(s-1, m), and RECV_B(s, m) needs SEND_B(s+1, m).

Sends never block and cost nothing by default; a receive blocks at its place in the list
until its send has run. ``with_communication`` puts each receive right before its
consumer, so that costs nothing; torch's lowering posts receives earlier (its runtime
waits for them only at the consumer), which this model reads as blocking, so a schedule
lowered by torch is accepted here but timed slower than torch would run it.

The result is the earliest start of every action given the order, exact for a runtime
that does nothing else; it is what the schedules' bubble formulas describe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.parallel.pipeline.validate import Location, validate_schedule

_F, _B = ActionType.FORWARD, ActionType.BACKWARD
_I, _W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT

DEFAULT_COSTS: Mapping[ActionType, float] = MappingProxyType(
    {kind: {_F: 1.0, _B: 2.0, _I: 1.0, _W: 1.0}.get(kind, 0.0) for kind in ActionType}
)


class ScheduleDeadlockError(ValueError):
    """No rank can make progress and some have actions left: the order is unrunnable.

    A ValueError because the schedule given is at fault, not the runtime.
    """


@dataclass(frozen=True)
class Simulation:
    """When every action of a schedule runs, and what that costs.

    Attributes:
        makespan: time from the first start to the last finish.
        busy: per rank, time spent running actions.
        bubble_fraction: idle share of all ranks' time, 1 - sum(busy) / (P * makespan).
        start: each action's start time.
        finish: each action's finish time.
        peak_live_activations: per stage, the most micro-batches whose forward has run on
            the stage and whose activations are not yet freed. They are freed by B, or by W
            when the backward is split: W still needs the layer inputs saved by the forward,
            so a deferred W keeps (part of) them alive, and counting them whole until W is
            the conservative bound.
        peak_live_per_rank: per rank, the same count summed over its stages at each point.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    start: dict[Action, float]
    finish: dict[Action, float]
    peak_live_activations: dict[int, int]
    peak_live_per_rank: tuple[int, ...]


def simulate(
    schedule: PipelineSchedule,
    cost: Mapping[ActionType, float] | None = None,
    durations: Mapping[Action, float] | None = None,
) -> Simulation:
    """Validate ``schedule``, then time it.

    Args:
        schedule: compute-only, or lowered with ``with_communication``.
        cost: time per action kind, overriding the defaults F=1, B=2, I=1, W=1 and 0 for
            transfers and REDUCE_GRAD.
        durations: time of individual actions, overriding ``cost`` for those named. Given
            the durations an executor measured, the makespan is what the step would take
            if the runtime added nothing between actions; the measured makespan minus this
            is the runtime's own overhead, free of the noise in the actions' lengths.

    Raises:
        ValueError: an invalid schedule (see ``validate_schedule``) or a negative or
            non-finite cost.
        TypeError: a cost key that is not an ActionType.
        ScheduleDeadlockError: the ranks block each other; the message names each blocked
            rank, the action it is at and what that action waits for.
    """
    costs = dict(DEFAULT_COSTS)
    for kind, value in (cost or {}).items():
        if not isinstance(kind, ActionType):
            raise TypeError(f"cost keys are ActionType members, got {kind!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"cost of {kind.name} must be finite and >= 0, got {value!r}")
        costs[kind] = float(value)
    each = dict(durations or {})
    for action, value in each.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"duration of {action} must be finite and >= 0, got {value!r}")
    where = validate_schedule(schedule)
    unknown = [str(a) for a in each if a not in where]
    if unknown:
        raise ValueError(f"durations name actions the schedule lacks: {', '.join(unknown[:5])}")

    def length(action: Action) -> float:
        return each.get(action, costs[action.kind])

    start, finish = _run(schedule, where, length)
    busy = tuple(sum(length(a) for a in row) for row in schedule.actions)
    makespan = max(finish.values(), default=0.0)
    total = schedule.num_ranks * makespan
    stage_peaks, rank_peaks = _live_activations(schedule)
    return Simulation(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - sum(busy) / total if total > 0 else 0.0,
        start=start,
        finish=finish,
        peak_live_activations=stage_peaks,
        peak_live_per_rank=rank_peaks,
    )


def start_times(schedule: PipelineSchedule) -> dict[Action, float]:
    """The start of every action under the default costs, without validating the schedule
    as a training step (a forward-only evaluation step has no backward actions).

    Raises:
        ScheduleDeadlockError: the ranks block each other.
    """
    where = {
        a: (rank, pos) for rank, row in enumerate(schedule.actions) for pos, a in enumerate(row)
    }
    return _run(schedule, where, lambda action: DEFAULT_COSTS[action.kind])[0]


def dependencies(action: Action, where: Mapping[Action, Location]) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` can start (besides the previous action
    on its rank), given the schedule's actions ``where``."""
    s, m = action.stage, action.microbatch
    kind = action.kind
    if kind is _F:
        return (Action(s - 1, _F, m),) if s > 0 else ()
    if kind in (_B, _I):
        grads = (Action(s + 1, _B, m), Action(s + 1, _I, m))
        return (Action(s, _F, m), *(g for g in grads if g in where))
    if kind is _W:
        return (Action(s, _I, m),)
    if kind is ActionType.RECV_F:
        return (Action(s - 1, ActionType.SEND_F, m),)
    if kind is ActionType.RECV_B:
        return (Action(s + 1, ActionType.SEND_B, m),)
    return ()  # sends and REDUCE_GRAD follow their producers on the same rank


def _run(
    schedule: PipelineSchedule,
    where: Mapping[Action, Location],
    length: Callable[[Action], float],
) -> tuple[dict[Action, float], dict[Action, float]]:
    rows = schedule.actions
    nxt = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    while True:
        progressed = False
        for rank, row in enumerate(rows):
            while nxt[rank] < len(row):
                action = row[nxt[rank]]
                deps = dependencies(action, where)
                if any(d not in finish for d in deps):
                    break
                begin = max([clock[rank], *(finish[d] for d in deps)])
                start[action], finish[action] = begin, begin + length(action)
                clock[rank] = finish[action]
                nxt[rank] += 1
                progressed = True
        if all(nxt[r] == len(row) for r, row in enumerate(rows)):
            return start, finish
        if not progressed:
            raise ScheduleDeadlockError(_deadlock_message(schedule, where, nxt, finish))


def _deadlock_message(
    schedule: PipelineSchedule,
    where: Mapping[Action, Location],
    nxt: list[int],
    finish: Mapping[Action, float],
) -> str:
    lines = [f"schedule {schedule.name!r} deadlocks; no rank can make progress:"]
    for rank, row in enumerate(schedule.actions):
        if nxt[rank] == len(row):
            lines.append(f"  rank {rank}: done")
            continue
        action = row[nxt[rank]]
        waits = [
            f"{d} (rank {where[d][0]}, position {where[d][1]}, not yet run)"
            for d in dependencies(action, where)
            if d not in finish
        ]
        lines.append(
            f"  rank {rank} blocked at position {nxt[rank]} on {action}, waiting for "
            + ", ".join(waits)
        )
    return "\n".join(lines)


def _live_activations(schedule: PipelineSchedule) -> tuple[dict[int, int], tuple[int, ...]]:
    """Live counts follow list order: a stage lives on one rank, which runs in order."""
    stage_peak = dict.fromkeys(range(schedule.num_stages), 0)
    rank_peak = []
    for row in schedule.actions:
        live: dict[int, int] = {}
        peak = 0
        for a in row:
            if a.kind is _F:
                live[a.stage] = live.get(a.stage, 0) + 1
                stage_peak[a.stage] = max(stage_peak[a.stage], live[a.stage])
            elif a.kind in (_B, _W):  # validation leaves one of the two per micro-batch
                live[a.stage] -= 1
            peak = max(peak, sum(live.values()))
        rank_peak.append(peak)
    return stage_peak, tuple(rank_peak)
