"""Pipeline schedules as data: per rank, the ordered list of actions it runs in one step.

A schedule is an instruction list, not code that runs a model: building one needs no
process, so every schedule is checked and timed in one process (``validate``,
``simulate``) before an executor runs it. The vocabulary and the string forms ("1F0",
"2SEND_F1", "0REDUCE_GRAD") are those of ``torch.distributed.pipelining``, and the CSV form
is the one its ``_dump_csv``/``_load_csv`` read and write, so schedules move both ways.

Stages are virtual (global) indices ``0 .. P*v - 1`` placed in a loop: stage ``s`` lives on
rank ``s % P``, as in Megatron-LM's and torch's interleaved schedules.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass


class ActionType(enum.Enum):
    """What an action does; the value is its string form."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "W"  # weight gradient only, deferrable into bubbles
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce the stage's gradients over data parallel, once

    @property
    def is_compute(self) -> bool:
        """Forward or backward work on a micro-batch."""
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        """A point-to-point transfer between adjacent stages (REDUCE_GRAD is not one: it is
        a data-parallel collective over the stage's gradients)."""
        return self in _COMM


_F, _B = ActionType.FORWARD, ActionType.BACKWARD
_I, _W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT
_COMPUTE = frozenset({_F, _B, _I, _W})
_COMM = frozenset({ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B})
# Longest names first, so that "SEND_F" is never read as stage digits followed by "F".
_KINDS = "|".join(sorted((k.value for k in ActionType), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KINDS})(\d*)")
_FORMS = (
    "'<stage><kind><microbatch>' such as '1F0', '0B3', '2SEND_F1', with kind one of "
    + ", ".join(k.value for k in ActionType if k is not ActionType.REDUCE_GRAD)
    + ", or '<stage>REDUCE_GRAD' (no micro-batch) such as '0REDUCE_GRAD'"
)


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction: ``kind`` on virtual stage ``stage`` for micro-batch ``microbatch``.

    Raises:
        ValueError: a negative index, or a micro-batch given to REDUCE_GRAD (which covers
            all of them) or missing from any other kind.
    """

    stage: int
    kind: ActionType
    microbatch: int | None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action stage must be >= 0, got {self.stage}")
        if (self.microbatch is None) != (self.kind is ActionType.REDUCE_GRAD):
            raise ValueError(
                f"{self.kind.name} on stage {self.stage} got microbatch={self.microbatch}: "
                "REDUCE_GRAD takes no micro-batch and every other kind needs one"
            )
        if self.microbatch is not None and self.microbatch < 0:
            raise ValueError(f"action micro-batch must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @staticmethod
    def parse(text: str) -> Action:
        """The action whose string form is ``text`` (the inverse of ``str``).

        Raises:
            ValueError: ``text`` is not one of the allowed forms.
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse pipeline action {text!r}: expected {_FORMS}")
        stage, kind, mb = match.groups()
        try:
            return Action(int(stage), ActionType(kind), int(mb) if mb else None)
        except ValueError as exc:
            raise ValueError(
                f"cannot parse pipeline action {text!r}: {exc}; expected {_FORMS}"
            ) from None

    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self.kind.is_compute

    @property
    def is_comm(self) -> bool:
        """SEND_F, RECV_F, SEND_B or RECV_B."""
        return self.kind.is_comm


@dataclass(frozen=True)
class PipelineSchedule:
    """Per rank, the actions of one training step in execution order.

    Construction checks only placement (each action on the rank owning its stage, indices in
    range); whether the schedule is complete, ordered and free of deadlock is
    ``validate.validate_schedule``'s and ``simulate.simulate``'s job, so that broken
    schedules can be built on purpose and diagnosed.

    Attributes:
        name: which schedule this is ("1f1b", or where a CSV came from).
        num_ranks: pipeline ranks P.
        num_microbatches: micro-batches M per step.
        virtual_stages: model chunks v per rank; there are P*v stages.
        actions: one tuple per rank. Compute-only schedules hold F/B/I/W only;
            ``with_communication`` adds the transfers and gradient reductions.

    Raises:
        ValueError: a non-positive size, a rank count different from ``len(actions)``, or an
            action outside the ranges or on a rank that does not hold its stage.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        for field in ("num_ranks", "num_microbatches", "virtual_stages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"schedule {self.name!r} has action lists for {len(self.actions)} ranks but "
                f"num_ranks={self.num_ranks}; give exactly one list per rank"
            )
        for rank, row in enumerate(self.actions):
            for pos, action in enumerate(row):
                self._check_placement(rank, pos, action)

    def _check_placement(self, rank: int, pos: int, action: Action) -> None:
        where = f"schedule {self.name!r}: action {action} (rank {rank}, position {pos})"
        if action.stage >= self.num_stages:
            raise ValueError(f"{where} names a stage outside 0..{self.num_stages - 1}")
        if action.microbatch is not None and action.microbatch >= self.num_microbatches:
            raise ValueError(f"{where} names a micro-batch outside 0..{self.num_microbatches - 1}")
        owner = self.stage_to_rank(action.stage)
        if owner != rank:
            raise ValueError(
                f"{where} is on the wrong rank: stage {action.stage} lives on rank {owner} "
                f"(stage s is on rank s % {self.num_ranks})"
            )

    @property
    def num_stages(self) -> int:
        """Virtual stages in the whole pipeline, P * v."""
        return self.num_ranks * self.virtual_stages

    def stage_to_rank(self, stage: int) -> int:
        """The rank holding ``stage`` (looping placement: ``stage % P``).

        Raises:
            ValueError: ``stage`` is outside ``0 .. num_stages - 1``.
        """
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        return stage % self.num_ranks

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in model order (its chunks 0 .. v-1).

        Raises:
            ValueError: ``rank`` is outside ``0 .. num_ranks - 1``.
        """
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is outside 0..{self.num_ranks - 1}")
        return tuple(range(rank, self.num_stages, self.num_ranks))

    @property
    def has_communication(self) -> bool:
        """Whether any action is a transfer or a gradient reduction."""
        return any(not a.is_compute for row in self.actions for a in row)

    def with_communication(self) -> PipelineSchedule:
        """This schedule with transfers and gradient reductions added.

        RECV_F goes immediately before each F of a stage other than the first, SEND_F
        immediately after each F of a stage other than the last; RECV_B immediately before
        each B or I of a stage other than the last, SEND_B immediately after each B or I of a
        stage other than the first. Each receive thus sits where its data is consumed and
        each send where its data is produced, so (with non-blocking sends) the transfers add
        no ordering the compute order did not already have: the lowered schedule deadlocks
        exactly when the compute-only one does. Torch instead places a receive where the
        sender's send is, which can post it earlier; both are valid.

        One REDUCE_GRAD per stage follows that stage's last backward action (B, or W when
        the backward is split), after its SEND_B, as torch's lowering does: the stage's
        gradients are final there, and the previous stage is not kept waiting.

        Adjacent stages on the same rank (only with one rank) exchange nothing, as in torch.

        Raises:
            ValueError: the schedule already has communication or reduction actions.
        """
        if self.has_communication:
            raise ValueError(
                f"schedule {self.name!r} already has communication actions; "
                "with_communication lowers a compute-only schedule"
            )
        rows = tuple(self._lower_rank(row) for row in self.actions)
        return PipelineSchedule(
            self.name, self.num_ranks, self.num_microbatches, self.virtual_stages, rows
        )

    def _lower_rank(self, row: tuple[Action, ...]) -> tuple[Action, ...]:
        last = self.num_stages - 1
        last_backward = {a.stage: pos for pos, a in enumerate(row) if a.kind in (_B, _W)}
        out: list[Action] = []
        for pos, a in enumerate(row):
            s, m = a.stage, a.microbatch
            if a.kind is _F and s > 0 and self._crosses(s - 1, s):
                out.append(Action(s, ActionType.RECV_F, m))
            if a.kind in (_B, _I) and s < last and self._crosses(s, s + 1):
                out.append(Action(s, ActionType.RECV_B, m))
            out.append(a)
            if a.kind is _F and s < last and self._crosses(s, s + 1):
                out.append(Action(s, ActionType.SEND_F, m))
            if a.kind in (_B, _I) and s > 0 and self._crosses(s - 1, s):
                out.append(Action(s, ActionType.SEND_B, m))
            if last_backward.get(s) == pos:
                out.append(Action(s, ActionType.REDUCE_GRAD, None))
        return tuple(out)

    def _crosses(self, stage: int, other: int) -> bool:
        return self.stage_to_rank(stage) != self.stage_to_rank(other)

    def to_csv(self) -> str:
        """Torch's CSV form: one row per rank, one action string per field."""
        buffer = io.StringIO()
        writer = csv.writer(buffer)  # torch's dialect: "excel", rows end in "\r\n"
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return buffer.getvalue()

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        name: str = "csv",
        num_microbatches: int | None = None,
        virtual_stages: int | None = None,
    ) -> PipelineSchedule:
        """Read torch's CSV form (as ``_dump_csv`` writes it, compute-only or with comms).

        Empty fields (torch's idle steps) are skipped. The rank count is the row count; the
        micro-batch and virtual-stage counts default to the smallest that cover the actions.

        Raises:
            ValueError: no rows, an unparsable field (named by rank and column), or actions
                that do not fit the sizes (see the class).
        """
        rows = list(csv.reader(io.StringIO(text)))
        if not rows:
            raise ValueError(f"schedule CSV {name!r} has no rows; expected one row per rank")
        actions: list[tuple[Action, ...]] = []
        for rank, row in enumerate(rows):
            parsed: list[Action] = []
            for col, field in enumerate(row):
                if not field.strip():
                    continue
                try:
                    parsed.append(Action.parse(field))
                except ValueError as exc:
                    raise ValueError(
                        f"schedule CSV {name!r}, rank {rank}, column {col}: {exc}"
                    ) from None
            actions.append(tuple(parsed))
        flat = [a for row in actions for a in row]
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch or 0 for a in flat), default=0)
        if virtual_stages is None:
            stages = 1 + max((a.stage for a in flat), default=0)
            virtual_stages = -(-stages // len(rows))
        return cls(name, len(rows), num_microbatches, virtual_stages, tuple(actions))

    def __str__(self) -> str:
        header = (
            f"{self.name}: {self.num_ranks} ranks, {self.num_microbatches} micro-batches, "
            f"{self.virtual_stages} stage(s) per rank"
        )
        cells = [[str(a) for a in row] for row in self.actions]
        width = max((len(c) for row in cells for c in row), default=0)
        label = len(f"rank {self.num_ranks - 1}")
        lines = [header]
        for rank, row in enumerate(cells):
            lines.append(f"{f'rank {rank}':<{label}} | " + " ".join(c.ljust(width) for c in row))
        return "\n".join(line.rstrip() for line in lines)
