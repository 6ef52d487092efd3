"""The order in which each rank posts its point-to-point messages, derived from the schedule.

NCCL matches messages between two ranks by order, not tag: the k-th send from rank A to rank
B meets the k-th receive B posts from A, and a rank's operations run in the order it posted
them. So every pair of ranks must post the messages they exchange in mirrored orders, and
no rank may post a receive ahead of a send its peer is waiting for.

The plan takes that order from the schedule itself. Simulated with unit costs
(``simulate``), every compute action gets a start time; every message gets the start time of
the action that consumes it (the receiving stage's F for activations, its B for gradients).
Each rank then interleaves its compute actions and its messages by time: a message timed
``t`` sits after every compute action starting before ``t`` and before the first starting
at or after it, on the sender (after the action that produced it, which finished by ``t``)
and on the receiver (right before the action that consumes it) alike. Messages of one rank
with the same time form one :class:`Exchange`, posted together (one NCCL group) in a
canonical order. Both sides of a message see the same time, so for every pair the exchanges
involving the other mirror each other, and since every rank follows one global time order
no rank ever waits on a message its peer has not reached: no deadlock, on any backend.

Descriptions of shapes (``boundary.py``) are not part of the plan: a step decides which
activation messages carry one (the first micro-batch of each new input fingerprint), on both
sides alike, and an exchange puts each description right before its data.

Pure data: no process group; ``nccl_rules.py`` checks plans against NCCL's rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from zerotrain.parallel.pipeline.messages import Channel
from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule
from zerotrain.parallel.pipeline.simulate import simulate, start_times
from zerotrain.utils.invariant import InvariantError

_F, _B = ActionType.FORWARD, ActionType.BACKWARD
_I, _W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
_SEND = {ActionType.SEND_F: Channel.ACTIVATIONS, ActionType.SEND_B: Channel.GRADIENTS}
# The other side of a transfer: activations go to the next stage, gradients to the previous.
_PEER_STAGE = {
    ActionType.SEND_F: 1,
    ActionType.RECV_F: -1,
    ActionType.SEND_B: -1,
    ActionType.RECV_B: 1,
}


@dataclass(frozen=True, slots=True, order=True)
class Message:
    """One boundary crossing: activations of ``stage`` (the sending stage) for micro-batch
    ``micro``, or the gradients of ``stage``'s outputs (``stage`` is the receiving one),
    as ``messages.tag`` numbers them."""

    channel: Channel
    stage: int
    micro: int

    def __str__(self) -> str:
        what = "activations" if self.channel is Channel.ACTIVATIONS else "gradients"
        return f"{what} of stage {self.stage}, micro-batch {self.micro}"


@dataclass(frozen=True, slots=True)
class Transfer:
    """This rank's side of one message."""

    kind: Literal["send", "recv"]
    peer: int
    message: Message


@dataclass(frozen=True, slots=True)
class Exchange:
    """Transfers posted together (one ``batch_isend_irecv``; one NCCL group), in canonical
    order: sends before receives, each by message."""

    time: float
    transfers: tuple[Transfer, ...]


PlanItem = Action | Exchange


@dataclass(frozen=True)
class CommPlan:
    """Per rank, its compute (and REDUCE_GRAD) actions and exchanges, in posting order."""

    schedule: PipelineSchedule
    items: tuple[tuple[PlanItem, ...], ...]
    split_backward: bool = False  # gradients are consumed by I actions, not B

    def exchanges(self, rank: int) -> list[Exchange]:
        return [item for item in self.items[rank] if isinstance(item, Exchange)]


def message_of(action: Action) -> Message:
    """The message a SEND_F/RECV_F/SEND_B/RECV_B action moves."""
    s, m = action.stage, action.microbatch
    if m is None:
        raise InvariantError(f"action {action} has no micro-batch")
    if action.kind is ActionType.SEND_F:
        return Message(Channel.ACTIVATIONS, s, m)
    if action.kind is ActionType.RECV_F:
        return Message(Channel.ACTIVATIONS, s - 1, m)
    if action.kind is ActionType.SEND_B:
        return Message(Channel.GRADIENTS, s - 1, m)
    if action.kind is ActionType.RECV_B:
        return Message(Channel.GRADIENTS, s, m)
    raise InvariantError(f"action {action} moves no message")


def consumer(message: Message, split_backward: bool = False) -> Action:
    """The compute action that waits for ``message``: a forward for activations; for
    gradients the backward, or its input half (I) where the schedule splits it."""
    if message.channel is Channel.ACTIVATIONS:
        return Action(message.stage + 1, _F, message.micro)
    return Action(message.stage, _I if split_backward else _B, message.micro)


@functools.lru_cache(maxsize=32)
def build_plan(schedule: PipelineSchedule, forward_only: bool = False) -> CommPlan:
    """The posting order of ``schedule`` (lowered: with transfers), or of its forward
    actions only (an evaluation step). Schedules that split backward (I/W) are planned
    too, their gradients consumed by I, though the executor runs F and B only.

    Raises:
        ValueError: the schedule is invalid (``simulate`` says why).
    """
    keep = {_F} if forward_only else {_F, _B, _I, _W, ActionType.REDUCE_GRAD}
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    split = any(a.kind is _I for row in rows for a in row)
    compute = PipelineSchedule(
        schedule.name, schedule.num_ranks, schedule.num_microbatches,
        schedule.virtual_stages, rows,
    )  # fmt: skip
    start = simulate(compute).start if not forward_only else start_times(compute)
    comm_kinds = {ActionType.SEND_F, ActionType.RECV_F}
    if not forward_only:
        comm_kinds |= {ActionType.SEND_B, ActionType.RECV_B}
    items = []
    for rank, row in enumerate(schedule.actions):
        transfers: dict[float, list[Transfer]] = {}
        for action in row:
            if action.kind not in comm_kinds:
                continue
            message = message_of(action)
            peer = schedule.stage_to_rank(action.stage + _PEER_STAGE[action.kind])
            kind: Literal["send", "recv"] = "send" if action.kind in _SEND else "recv"
            transfer = Transfer(kind, peer, message)
            transfers.setdefault(start[consumer(message, split)], []).append(transfer)
        items.append(_interleave(rows[rank], start, transfers))
    return CommPlan(schedule, tuple(items), split)


def _interleave(
    compute: tuple[Action, ...], start: dict[Action, float], transfers: dict[float, list[Transfer]]
) -> tuple[PlanItem, ...]:
    exchanges = [
        Exchange(t, tuple(sorted(found, key=lambda x: (x.kind != "send", x.message, x.peer))))
        for t, found in sorted(transfers.items())
    ]
    out: list[PlanItem] = []
    k = 0
    for action in compute:
        while k < len(exchanges) and exchanges[k].time <= start[action]:
            out.append(exchanges[k])
            k += 1
        out.append(action)
    out.extend(exchanges[k:])
    return tuple(out)
