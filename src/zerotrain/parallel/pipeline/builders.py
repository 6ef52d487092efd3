"""The standard pipeline schedules, built as data (compute actions only).

Every builder returns a :class:`PipelineSchedule` whose per-rank compute order equals
``torch.distributed.pipelining``'s for the same schedule (tests compare them), so a schedule
here and torch's runtime agree on what each rank does. ``with_communication`` adds the
transfers; ``simulate`` times the result.

Notation: P ranks, M micro-batches, v stages (model chunks) per rank, rank r.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from zerotrain.parallel.pipeline.schedule import Action, ActionType, PipelineSchedule

_F, _B = ActionType.FORWARD, ActionType.BACKWARD
_I, _W = ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT

_ALIASES = {"interleaved_1f1b": "interleaved", "zbh1": "zb-h1"}


def gpipe(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe (fill-drain): every rank runs all M forwards, then all M backwards, both in
    micro-batch order (torch's ScheduleGPipe runs backwards in that order too).

    Each stage holds the activations of all M micro-batches at its peak; the bubble fraction
    is (P-1)/(M+P-1) for any forward and backward costs.

    Raises:
        ValueError: P or M below 1.
    """
    _check_sizes(num_ranks, num_microbatches)
    rows = tuple(
        tuple(Action(r, _F, m) for m in range(num_microbatches))
        + tuple(Action(r, _B, m) for m in range(num_microbatches))
        for r in range(num_ranks)
    )
    return PipelineSchedule("gpipe", num_ranks, num_microbatches, 1, rows)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush): rank r runs P-1-r warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    Stage s holds at most P-s micro-batches' activations (GPipe holds M) with the same
    bubble fraction (P-1)/(M+P-1).

    Raises:
        ValueError: M < P (the warm-up would run out of micro-batches; GPipe has no such
            limit), or P or M below 1.
    """
    _check_sizes(num_ranks, num_microbatches)
    if num_microbatches < num_ranks:
        raise ValueError(
            f"1f1b got {num_microbatches} micro-batches for {num_ranks} stages: 1F1B needs at "
            "least as many micro-batches as stages; use more micro-batches, or 'gpipe'"
        )
    rows = tuple(
        _rank_order(r, num_ranks, num_microbatches, 1, warmup=num_ranks - 1 - r)
        for r in range(num_ranks)
    )
    return PipelineSchedule("1f1b", num_ranks, num_microbatches, 1, rows)


def interleaved_one_f_one_b(
    num_ranks: int, num_microbatches: int, virtual_stages: int
) -> PipelineSchedule:
    """Megatron-LM's interleaved 1F1B: each rank holds v chunks (stages r, r+P, ...), and
    micro-batches go through them in groups of P: forwards run chunk 0 on micro-batches
    0..P-1, chunk 1 on 0..P-1, ..., chunk v-1, then chunk 0 on P..2P-1, and so on;
    backwards run the chunks in reverse order (v-1 first) with the same grouping.

    Rank r runs w_r = min((v-1)*P + 2*(P-1-r), v*M) warm-up forwards (Megatron's count, and
    torch's ScheduleInterleaved1F1B's), then alternates one forward and one backward, then
    drains. Unlike Megatron, M == P is not special-cased into an all-forward warm-up: this
    follows torch, whose order the tests compare with. Micro-batch m of chunk c is the
    k-th forward of the rank for k = (m // P) * v * P + c * P + m % P.

    Live activations (counted per chunk, each 1/v of a 1F1B stage's): stage s = c*P + r
    (chunk c of rank r) holds at most

        min(M, min(x, P) + clamp(x - v*P, 0, P)),  x = 2*(v-1-c)*P + 2*(P-1-r) + 1,

    where x is how many forwards rank r runs from chunk c's first forward up to its first
    backward: the first x forwards fill chunk c's first group of P, and any beyond v*P
    (one full round of the rank's chunks) start its second group. So the last chunk holds
    min(P, 2*(P-1-r) + 1); with v = 2 and M >= 2P, chunk 0 holds P + min(P, 2*(P-1-r) + 1).
    Rank r as a whole peaks at min(w_r + 1, v*M) (warm-up plus one steady forward).

    Bubble: with the same per-chunk costs F and B on every rank the step takes
    (v*M + P - 1) * (F + B), a bubble fraction of (P-1)/(v*M+P-1). The simulator shows
    this exactly for F:B of 1:1, 1:2, 1:3 and 2:1 (tested) and 1:0.5, 1:1.5, 1:4, 3:1, with
    P <= 6, v <= 4, M up to 5P; it is checked there, not proven for every ratio.

    Raises:
        ValueError: v < 2 (use '1f1b'), M not a multiple of P (Megatron-LM's constraint:
            the micro-batches go through the chunks in whole groups of P; torch relaxes it,
            this does not), or P or M below 1.
    """
    _check_sizes(num_ranks, num_microbatches)
    if virtual_stages < 2:
        raise ValueError(
            f"interleaved 1F1B needs virtual_stages >= 2 chunks per rank, got "
            f"{virtual_stages}; with one chunk per rank use '1f1b'"
        )
    if num_microbatches % num_ranks:
        raise ValueError(
            f"interleaved 1F1B needs the number of micro-batches to be a multiple of the "
            f"number of ranks (Megatron-LM's constraint), got {num_microbatches} "
            f"micro-batches for {num_ranks} ranks"
        )
    rows = tuple(
        _rank_order(
            r,
            num_ranks,
            num_microbatches,
            virtual_stages,
            warmup=_interleaved_warmup(r, num_ranks, num_microbatches, virtual_stages),
        )
        for r in range(num_ranks)
    )
    return PipelineSchedule("interleaved", num_ranks, num_microbatches, virtual_stages, rows)


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """ZB-H1 from Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (the handcrafted
    schedule with 1F1B's peak memory): each backward is split into I (input gradient, which
    the previous stage waits for) and W (weight gradient, which nobody waits for).

    Rank r runs 1F1B's P-1-r warm-up forwards and 1F1B's order of F and I, but leaves the W
    of its first r backwards pending: each later I is followed by the oldest pending W, and
    the last r Ws run at the end, where 1F1B leaves rank r idle. Activations are freed by W,
    so every rank holds at most P micro-batches (1F1B's peak, on its first rank). With F, I
    and W costing one unit each the bubble is P-1 units per rank, a third of 1F1B's
    3(P-1) with B = I + W = 2. This is torch's ScheduleInterleavedZeroBubble with one stage
    per rank.

    Raises:
        ValueError: M < P (as for 1F1B), or P or M below 1.
    """
    _check_sizes(num_ranks, num_microbatches)
    if num_microbatches < num_ranks:
        raise ValueError(
            f"zb-h1 got {num_microbatches} micro-batches for {num_ranks} stages: like 1F1B it "
            "needs at least as many micro-batches as stages; use more, or 'gpipe'"
        )
    rows = tuple(
        _rank_order(r, num_ranks, num_microbatches, 1, warmup=num_ranks - 1 - r, weight_delay=r)
        for r in range(num_ranks)
    )
    return PipelineSchedule("zb-h1", num_ranks, num_microbatches, 1, rows)


_BUILDERS: dict[str, Callable[[int, int, int], PipelineSchedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved_one_f_one_b,
    "zb-h1": lambda p, m, v: zero_bubble_h1(p, m),
}


def build_schedule(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """The schedule called ``name``: "gpipe", "1f1b", "interleaved" (or "interleaved_1f1b")
    or "zb-h1" (or "zbh1"), case-insensitive.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones), virtual_stages
            other than 1 for a one-stage-per-rank schedule, or the builder's own limits.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _BUILDERS:
        allowed = ", ".join([*_BUILDERS, *_ALIASES])
        raise ValueError(f"unknown pipeline schedule {name!r}; the schedules are {allowed}")
    if key != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank (virtual_stages=1), got "
            f"virtual_stages={virtual_stages}; use 'interleaved' for several stages per rank"
        )
    return _BUILDERS[key](num_ranks, num_microbatches, virtual_stages)


def _check_sizes(num_ranks: int, num_microbatches: int) -> None:
    for field, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be an integer >= 1, got {value!r}")


def _interleaved_warmup(rank: int, num_ranks: int, num_microbatches: int, chunks: int) -> int:
    """Megatron's warm-up: enough forwards to fill every chunk but the last for one group,
    plus two per hop to the last rank (the round trip of the first backward)."""
    return min((chunks - 1) * num_ranks + 2 * (num_ranks - 1 - rank), chunks * num_microbatches)


def _rank_order(
    rank: int,
    num_ranks: int,
    num_microbatches: int,
    chunks: int,
    *,
    warmup: int,
    weight_delay: int | None = None,
) -> tuple[Action, ...]:
    """One rank's warm-up / steady 1F1B / cool-down order over its ``chunks`` stages.

    With ``weight_delay`` set, backwards are split into I and W, and W trails I by
    ``weight_delay`` backwards (the pending ones run at the end).
    """
    total = chunks * num_microbatches
    group = num_ranks * chunks  # one pass of P micro-batches through every chunk

    def forward(k: int) -> Action:
        chunk = (k // num_ranks) % chunks
        return Action(chunk * num_ranks + rank, _F, (k // group) * num_ranks + k % num_ranks)

    def backward(k: int) -> Action:
        chunk = chunks - 1 - (k // num_ranks) % chunks
        return Action(chunk * num_ranks + rank, _B, (k // group) * num_ranks + k % num_ranks)

    out: list[Action] = []
    pending: deque[Action] = deque()

    def run_backward(k: int) -> None:
        full = backward(k)
        if weight_delay is None:
            out.append(full)
            return
        out.append(Action(full.stage, _I, full.microbatch))
        pending.append(Action(full.stage, _W, full.microbatch))
        if k >= weight_delay:
            out.append(pending.popleft())

    out.extend(forward(k) for k in range(warmup))
    for k in range(total - warmup):
        out.append(forward(warmup + k))
        run_backward(k)
    for k in range(total - warmup, total):
        run_backward(k)
    out.extend(pending)
    return tuple(out)
