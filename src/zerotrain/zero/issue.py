"""Issuing what a unit described (``shard.io.CollectiveIO``) over a communicator."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import torch

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import Communicator, Handle
from zerotrain.shard.io import CollectiveIO
from zerotrain.utils.invariant import invariant
from zerotrain.utils.torch_compat import preserve_version_counter


def issue(comm: Communicator, io: CollectiveIO, *, async_op: bool = True) -> Handle:
    """Start ``io`` over ``comm``; its ``on_done`` runs when the returned handle is waited
    on (at once when ``async_op`` is False)."""
    guard = preserve_version_counter(io.output) if io.keep_version else contextlib.nullcontext()
    purpose, done, label = io.purpose, io.on_done, io.label
    with guard:
        if io.op == "all_gather":
            return comm.all_gather_into(
                io.output, io.input, purpose=purpose, async_op=async_op, on_done=done, label=label
            )
        if io.op == "reduce_scatter":
            return comm.reduce_scatter(
                io.output, io.input, purpose=purpose, async_op=async_op, on_done=done, label=label
            )
        return comm.all_reduce(
            io.output, purpose=purpose, async_op=async_op, on_done=done, label=label
        )


# Collectives smaller than this are latency-bound: several of them cost about what one of
# their combined size costs. Above it a collective is bandwidth-bound, and combining would
# only add a copy in and out of a temporary buffer.
COALESCE_NUMEL = 1 << 20


def reduce_batch_numel(bucket_numel: int | None) -> int:
    """Stage 3: the most elements one gradient reduce-scatter carries for a batch of small
    units: ``reduce_bucket_size`` (DeepSpeed's stage-3 reduction buckets) up to
    ``COALESCE_NUMEL``; unset: ``COALESCE_NUMEL``; 0: no batches."""
    return COALESCE_NUMEL if bucket_numel is None else min(bucket_numel, COALESCE_NUMEL)


def is_small_unit(numel: int, cap: int) -> bool:
    """Whether a unit of ``numel`` elements is small enough to be batched with its
    neighbours into collectives of up to ``cap`` elements (at most an eighth of it)."""
    return numel <= cap // 8


def batch_small_units(sizes: Sequence[int], kinds: Sequence[object], cap: int) -> list[range]:
    """Positions ``0..len(sizes)-1`` (units in launch order, by padded size) cut into
    consecutive batches: runs of small units (at most ``cap // 8`` elements) of one kind
    (dtype and device; None: never batched) share a batch up to ``cap`` elements; every
    other unit is a batch of its own.

    On a model of many small units (every stage-3 block below a few hundred thousand
    parameters) each reduction is latency-bound, and one collective per unit costs the
    step more than its arithmetic does."""

    def run(k: int) -> object:
        small = kinds[k] is not None and is_small_unit(sizes[k], cap)
        return ("small", kinds[k]) if small else ("alone", k)

    batches: list[range] = []
    for _, members in itertools.groupby(range(len(sizes)), key=run):
        positions = list(members)
        first = positions[0]
        for bucket in plan_buckets([sizes[k] for k in positions], cap):
            batches.append(range(first + bucket.start, first + bucket.stop))
    return batches


def batch_all_gathers(ios: Sequence[CollectiveIO], cap: int = COALESCE_NUMEL) -> list[list[int]]:
    """Positions of ``ios`` (all-gathers) grouped into batches, in order: consecutive
    all-gathers of one dtype and device share a batch while their outputs together hold at
    most ``cap`` elements; a larger one goes alone."""
    for io in ios:
        invariant(io.op == "all_gather", f"batch_all_gathers given a {io.op}")
    batches: list[list[int]] = []
    kind = [(io.output.dtype, io.output.device) for io in ios]
    for _, members in itertools.groupby(range(len(ios)), key=kind.__getitem__):
        run = list(members)
        numels = [ios[k].output.numel() for k in run]
        batches += [[run[i] for i in bucket] for bucket in plan_buckets(numels, cap)]
    return batches


def issue_all_gathers(comm: Communicator, ios: Sequence[CollectiveIO]) -> list[Handle]:
    """Start every all-gather of ``ios`` (several units' updated slices), consecutive small
    ones combined into one collective (``batch_all_gathers``); each io's ``on_done`` runs
    when its handle is waited on. Every rank must give the same ios, in the same order."""
    if comm.world_size == 1:  # nothing moves: combining would only copy
        return [issue(comm, io) for io in ios]
    handles = []
    for batch in batch_all_gathers(ios):
        if len(batch) == 1:
            handles.append(issue(comm, ios[batch[0]]))
        else:
            handles.append(_issue_combined(comm, [ios[k] for k in batch]))
    return handles


def _issue_combined(comm: Communicator, ios: Sequence[CollectiveIO]) -> Handle:
    """One all-gather carrying every io's input: this rank's inputs side by side go out as
    one chunk, and each rank's chunk is cut back into the ios' outputs."""
    world = comm.world_size
    sizes = [io.input.numel() for io in ios]
    chunk = sum(sizes)
    first = ios[0].output
    packed = torch.cat([io.input.reshape(-1) for io in ios])
    gathered = torch.empty(chunk * world, dtype=first.dtype, device=first.device)

    def unpack() -> None:
        # Rank r's chunk holds every io's piece side by side: as a (world, chunk) matrix,
        # io k's pieces are a band of columns, copied into its output viewed the same way.
        columns = gathered.view(world, chunk).split(sizes, dim=1)
        targets = [io.output.view(world, n) for io, n in zip(ios, sizes, strict=True)]
        with contextlib.ExitStack() as guards:
            for io in ios:
                if io.keep_version:
                    guards.enter_context(preserve_version_counter(io.output))
            torch._foreach_copy_(targets, list(columns))
        _each_done(ios)

    return comm.all_gather_into(
        gathered, packed, purpose=ios[0].purpose, async_op=True, on_done=unpack, label=_label(ios)
    )


def issue_reduce_scatters(comm: Communicator, ios: Sequence[CollectiveIO]) -> Handle:
    """One reduce-scatter carrying every io of ``ios`` (small units' gradients, one dtype
    and device): each io's input is cut into its ranks' chunks, and the chunks go to a
    buffer laid out rank by rank, every io's chunk side by side, so that one collective
    leaves each rank the sum of its own chunks; they are copied into the ios' outputs and
    each io's ``on_done`` runs, in order, when the handle is waited on."""
    invariant(
        all(io.op == "reduce_scatter" for io in ios),
        "issue_reduce_scatters: not all reduce-scatters",
    )
    world = comm.world_size
    sizes = [io.output.numel() for io in ios]
    chunk = sum(sizes)
    first = ios[0].input
    packed = torch.empty(chunk * world, dtype=first.dtype, device=first.device)
    columns = packed.view(world, chunk).split(sizes, dim=1)
    torch._foreach_copy_(
        list(columns), [io.input.view(world, n) for io, n in zip(ios, sizes, strict=True)]
    )
    reduced = torch.empty(chunk, dtype=first.dtype, device=first.device)

    def unpack() -> None:
        torch._foreach_copy_([io.output for io in ios], list(reduced.split(sizes)))
        _each_done(ios)

    return comm.reduce_scatter(
        reduced, packed, purpose=ios[0].purpose, async_op=True, on_done=unpack, label=_label(ios)
    )


def _each_done(ios: Sequence[CollectiveIO]) -> None:
    """Run each io's ``on_done``, in order (their results are in their outputs)."""
    for io in ios:
        if io.on_done is not None:
            io.on_done()


def _label(ios: Sequence[CollectiveIO]) -> str:
    """How messages name a collective carrying several units'."""
    return f"{ios[0].label} .. {ios[-1].label} ({len(ios)} units)"
