"""Replay what each rank posts and waits for under NCCL's point-to-point rules, in one
process, and say where they would deadlock or exchange the wrong data.

The rules (ProcessGroupNCCL, messages above NCCL's buffering, about 4 MB: below it a send
may complete before its receive is posted, which only hides a bad order):

- each rank runs its posted groups in order on one stream: a group starts once every
  earlier group of the rank has completed;
- the k-th send from A to B meets the k-th receive B posts from A, whatever the tags;
- a send and its receive complete together, once both their groups have started; a group
  completes when all of its operations have;
- a rank's host program posts groups without waiting; it stops at a wait until the awaited
  operation completed.

A pair whose k-th send and receive were meant for different messages is a mismatch (NCCL
would deliver one message's bytes into the other's buffer, silently when the sizes agree);
a state where no rank can move and some have work left is a deadlock.

:func:`host_programs` writes down what the executor posts and waits for when it follows a
``CommPlan``, description messages included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from zerotrain.parallel.pipeline.plan import CommPlan, Exchange, Message, consumer


class NcclOrderError(ValueError):
    """Posting orders that NCCL would deadlock on, or match to the wrong messages."""


@dataclass(frozen=True, slots=True)
class Op:
    """One send or receive: ``what`` names the message (a description is its own message)."""

    kind: Literal["send", "recv"]
    peer: int
    what: str


@dataclass(frozen=True, slots=True)
class Post:
    """Post ``ops`` as one group (``batch_isend_irecv``)."""

    ops: tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until ``op`` (posted earlier by this rank) completed."""

    op: Op


Event = Post | Wait


def _what(message: Message, description: bool = False) -> str:
    return f"description of {message}" if description else str(message)


def host_programs(plan: CommPlan, described: frozenset[Message] = frozenset()) -> list[list[Event]]:
    """What each rank's executor posts and waits for in one step of ``plan``: an exchange
    posts its descriptions (of the activation messages in ``described``) as one group,
    waits for the ones it receives (the data's buffers need their shapes), then posts its
    data as another; a compute action waits for the messages it consumes; the step ends
    waiting for every send."""
    programs = []
    for items in plan.items:
        events: list[Event] = []
        sends: list[Op] = []
        for item in items:
            if isinstance(item, Exchange):
                heads = tuple(
                    Op(t.kind, t.peer, _what(t.message, True))
                    for t in item.transfers
                    if t.message in described
                )
                if heads:
                    events.append(Post(heads))
                    events += [Wait(op) for op in heads if op.kind == "recv"]
                data = tuple(Op(t.kind, t.peer, _what(t.message)) for t in item.transfers)
                events.append(Post(data))
                sends += [op for op in (*heads, *data) if op.kind == "send"]
                continue
            for t in _inputs_of(plan, items, item):
                events.append(Wait(Op("recv", t[0], _what(t[1]))))
        events += [Wait(op) for op in sends]
        programs.append(events)
    return programs


def _inputs_of(
    plan: CommPlan, items: Sequence[object], action: object
) -> list[tuple[int, Message]]:
    """The received messages a compute action consumes (peer, message)."""
    found = []
    for item in items:
        if isinstance(item, Exchange):
            for t in item.transfers:
                if t.kind == "recv" and consumer(t.message, plan.split_backward) == action:
                    found.append((t.peer, t.message))
    return found


@dataclass
class _Group:
    rank: int
    ops: list[int]
    done: bool = False


@dataclass
class _State:
    group_of: list[int] = field(default_factory=list)  # op id -> group id
    op_info: list[tuple[int, Op]] = field(default_factory=list)  # op id -> (rank, op)
    completed: set[int] = field(default_factory=set)


def check_nccl_order(programs: Sequence[Sequence[Event]]) -> None:
    """Replay ``programs`` (one per rank) under NCCL's rules.

    Raises:
        NcclOrderError: a mismatch (naming both ranks and both messages) or a deadlock
            (naming where each unfinished rank stands).
    """
    ranks = len(programs)
    state = _State()
    groups: list[_Group] = []
    stream: list[list[int]] = [[] for _ in range(ranks)]  # group ids in posting order
    head = [0] * ranks  # first group of each stream not completed
    pc = [0] * ranks
    posted: dict[tuple[int, Op], list[int]] = {}  # (rank, op) -> its op ids, in order
    sends: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> send op ids in order
    recvs: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> recv op ids in order

    def started(op_id: int) -> bool:
        g = state.group_of[op_id]
        rank = groups[g].rank
        return head[rank] < len(stream[rank]) and stream[rank][head[rank]] == g

    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):  # host programs advance
            while pc[rank] < len(program):
                event = program[pc[rank]]
                if isinstance(event, Post):
                    ids = []
                    for op in event.ops:
                        op_id = len(state.op_info)
                        state.op_info.append((rank, op))
                        state.group_of.append(len(groups))
                        posted.setdefault((rank, op), []).append(op_id)
                        pair = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                        (sends if op.kind == "send" else recvs).setdefault(pair, []).append(op_id)
                        ids.append(op_id)
                    stream[rank].append(len(groups))
                    groups.append(_Group(rank, ids))
                else:
                    found = posted.get((rank, event.op), [])
                    if not found:
                        raise NcclOrderError(
                            f"rank {rank} waits for {event.op.kind} of {event.op.what} "
                            f"{'to' if event.op.kind == 'send' else 'from'} rank "
                            f"{event.op.peer}, which it never posted"
                        )
                    if found[0] not in state.completed:
                        break
                pc[rank] += 1
                progressed = True
        for (src, dst), send_ids in sends.items():  # matched pairs complete
            for k, send_id in enumerate(send_ids):
                recv_ids = recvs.get((src, dst), [])
                if k >= len(recv_ids) or send_id in state.completed:
                    continue
                recv_id = recv_ids[k]
                _check_match(state, send_id, recv_id, k)
                if started(send_id) and started(recv_id):
                    state.completed |= {send_id, recv_id}
                    progressed = True
        for rank in range(ranks):  # finished groups leave their streams
            while head[rank] < len(stream[rank]):
                group = groups[stream[rank][head[rank]]]
                if not all(op in state.completed for op in group.ops):
                    break
                group.done = True
                head[rank] += 1
                progressed = True
    unfinished = [r for r in range(ranks) if pc[r] < len(programs[r])]
    if unfinished:
        raise NcclOrderError(_deadlock(programs, pc, unfinished, state, groups, stream, head))
    # Every program ran to its end; what it posted must all have been matched too: an
    # unmatched operation would meet the next step's messages, or hang it.
    left = [
        f"rank {rank}: {op.kind} of {op.what} {'to' if op.kind == 'send' else 'from'} "
        f"rank {op.peer}"
        for op_id, (rank, op) in enumerate(state.op_info)
        if op_id not in state.completed
    ]
    if left:
        shown = "; ".join(left[:4]) + (f"; and {len(left) - 4} more" if len(left) > 4 else "")
        raise NcclOrderError(f"operations posted but never matched at the end: {shown}")


def _check_match(state: _State, send_id: int, recv_id: int, k: int) -> None:
    src, send = state.op_info[send_id]
    dst, recv = state.op_info[recv_id]
    if send.what != recv.what:
        raise NcclOrderError(
            f"mismatch: the send number {k} from rank {src} to rank {dst} carries {send.what}, "
            f"but rank {dst}'s receive number {k} from rank {src} expects {recv.what}"
        )


def _deadlock(
    programs: Sequence[Sequence[Event]],
    pc: list[int],
    unfinished: list[int],
    state: _State,
    groups: list[_Group],
    stream: list[list[int]],
    head: list[int],
) -> str:
    lines = ["deadlock: no rank can make progress"]
    for rank in unfinished:
        event = programs[rank][pc[rank]]
        waiting = f"waits for {event.op.kind} of {event.op.what}" if isinstance(event, Wait) else ""
        blocked = ""
        if head[rank] < len(stream[rank]):
            group = groups[stream[rank][head[rank]]]
            pending = [state.op_info[i][1] for i in group.ops if i not in state.completed]
            blocked = "; its stream is stuck at " + ", ".join(
                f"{op.kind} of {op.what} {'to' if op.kind == 'send' else 'from'} rank {op.peer}"
                for op in pending
            )
        lines.append(f"  rank {rank} {waiting}{blocked}")
    return "\n".join(lines)


__all__ = [
    "Event",
    "NcclOrderError",
    "Op",
    "Post",
    "Wait",
    "check_nccl_order",
    "host_programs",
]
