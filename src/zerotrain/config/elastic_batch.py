"""Elastic batch planning: one global batch that every allowed world size can train with.

A job that may shrink or grow (a host dies, another joins) keeps its convergence only if the
global batch stays the same; each world size then splits it into micro-batches and
accumulation steps. Given the micro-batch sizes a model can run and the largest acceptable
global batch, this picks the global batch that the most world sizes in ``[min_gpus,
max_gpus]`` can split exactly: DeepSpeed's ``elasticity`` algorithm (versions 0.1 and 0.2,
from DeepSpeed 0.19.5, the last release that has it), reimplemented so a config gives the
same batch and world sizes as there.

Candidates are, for each micro-batch size and for their least common multiple, that base
times the largest highly composite number that keeps it within the limit (highly composite
numbers have the most divisors for their size, so the most world sizes divide them). The
candidate with the most valid world sizes wins; ties go to the larger batch
(``prefer_larger_batch``) or the smaller. Version 0.2 plans per node
(``num_gpus_per_node``, ``model_parallel_size``) and, when the current world size is not
one of the valid ones, falls back to the largest batch that world size can split.

Pure functions, no torch: unit-tested against DeepSpeed's results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The highly composite numbers up to 720720 (each has more divisors than any smaller
# number): enough for global batches of hundreds of thousands.
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip


class ElasticityError(ValueError):
    """An elastic plan that cannot be made (DeepSpeed's ``ElasticityError``)."""


class ElasticityIncompatibleWorldSize(ElasticityError):  # noqa: N818 (DeepSpeed's name)
    """The job's world size is not one the plan allows."""


@dataclass(frozen=True)
class ElasticOptions:
    """The ``elasticity`` section's values that decide the plan."""

    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int = 1
    max_gpus: int = 10000
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    prefer_larger_batch: bool = True
    version: float = 0.2


@dataclass(frozen=True)
class ElasticPlan:
    """The global batch, the world sizes that can train it, and (for a given world size)
    how that world size splits it."""

    train_batch_size: int
    valid_world_sizes: tuple[int, ...]
    world_size: int | None = None
    micro_batch_size: int | None = None
    # Version 0.2 only: no planned world size is this one, so the batch is the largest
    # this world size alone can split (it differs from what other world sizes would get).
    own_batch: bool = False

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """Micro-steps per optimizer step at ``world_size`` (None without one)."""
        if self.world_size is None or self.micro_batch_size is None:
            return None
        return self.train_batch_size // (self.micro_batch_size * self.world_size)


def _largest_hcn_at_most(value: int) -> int:
    return max(h for h in HIGHLY_COMPOSITE if h <= value) if value >= 1 else 1


def candidate_batch_sizes(bases: Sequence[int], max_batch: int) -> list[int]:
    """Each base times the largest highly composite number keeping it within ``max_batch``
    (a base at or above the limit is its own candidate), without repeats, ascending."""
    found = {b if b >= max_batch else b * _largest_hcn_at_most(max_batch // b) for b in bases}
    return sorted(found)


def valid_world_sizes(
    batch: int, micro_batches: Sequence[int], min_gpus: int, max_gpus: int
) -> list[int]:
    """World sizes in ``[min_gpus, max_gpus]`` that split ``batch`` into equal micro-batches
    of one of ``micro_batches`` with whole accumulation steps, ascending."""
    sizes: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        sizes.update(w for w in range(min_gpus, min(max_gpus, most) + 1) if most % w == 0)
    return sorted(sizes)


def _best(
    candidates: Sequence[int],
    micro_batches: Sequence[int],
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool,
) -> tuple[int, list[int]]:
    """The candidate with the most valid world sizes; ties to the larger (or smaller)."""
    best_batch, best_sizes = min(micro_batches), list[int]()
    for batch in candidates:
        sizes = valid_world_sizes(batch, micro_batches, min_gpus, max_gpus)
        wins_tie = batch > best_batch if prefer_larger else batch < best_batch
        if len(sizes) > len(best_sizes) or (len(sizes) == len(best_sizes) and wins_tie):
            best_batch, best_sizes = batch, sizes
    return best_batch, best_sizes


def _plan_v01(
    micro_batches: Sequence[int],
    max_batch: int,
    min_gpus: int | None,
    max_gpus: int | None,
    prefer_larger: bool,
) -> tuple[int, list[int]]:
    low = min_gpus or 1
    high = max_gpus or max_batch // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_batch]
    if too_big:
        raise ElasticityError(
            f"elasticity.micro_batch_sizes {too_big} exceed max_train_batch_size ({max_batch})"
        )
    bases = [*micro_batches, math.lcm(*micro_batches)]
    return _best(candidate_batch_sizes(bases, max_batch), micro_batches, low, high, prefer_larger)


def _micro_for(batch: int, divisor: int, micro_batches: Sequence[int], larger: bool) -> int | None:
    """Version 0.2's micro-batch pick: the first (or the largest) size dividing
    ``batch // divisor``."""
    chosen = None
    for micro in micro_batches:
        if (batch // divisor) % micro == 0 and (chosen is None or (larger and micro > chosen)):
            chosen = micro
    return chosen


def _plan_v02(opts: ElasticOptions, world_size: int) -> tuple[int, list[int], bool]:
    """``(batch, valid world sizes, whether the batch is the current world size's own)``."""
    per_node, mp = opts.num_gpus_per_node, opts.model_parallel_size
    if per_node % mp:
        raise ElasticityError(
            f"elasticity version 0.2: num_gpus_per_node ({per_node}) must be a multiple of "
            f"model_parallel_size ({mp})"
        )
    dp_per_node = per_node // mp
    micro_batches = opts.micro_batch_sizes
    # Planned per node: a node's data-parallel ranks act as one.
    batch, nodes = _plan_v01(
        micro_batches,
        int(opts.max_train_batch_size / dp_per_node),
        int(opts.min_gpus / per_node),
        int(opts.max_gpus / per_node),
        opts.prefer_larger_batch,
    )
    # No node count in range may fit (then only the current world size's own batch below
    # is left; DeepSpeed does the same when prefer_larger_batch, and fails otherwise).
    batch *= dp_per_node
    valid = [n * dp_per_node for n in nodes]
    if world_size // mp in valid:
        return batch, valid, False
    # The current world size is not one of them: the largest (or smallest) batch it can
    # split, for it alone.
    dp = world_size / per_node * dp_per_node
    options = [math.floor(opts.max_train_batch_size / (m * dp)) * m * dp for m in micro_batches]
    fallback = int(max(options) if opts.prefer_larger_batch else min(options))
    micro = _micro_for(fallback, world_size, micro_batches, opts.prefer_larger_batch)
    if fallback == 0 or micro is None:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not valid for the elastic plan ({valid}), and no "
            f"global batch up to {opts.max_train_batch_size} splits over it into "
            f"micro-batches of {list(micro_batches)}"
        )
    return fallback, [int(dp)], True


def plan_elastic_batch(opts: ElasticOptions, world_size: int = 0) -> ElasticPlan:
    """The elastic plan of ``opts``; with ``world_size`` (the data-parallel world size of
    the job, > 0) also its micro-batch, the largest size that splits the batch there.

    Raises:
        ElasticityError: the options allow no plan (version 0.2 needs a world size).
        ElasticityIncompatibleWorldSize: ``world_size`` is not one the plan allows.
    """
    micro_batches = list(opts.micro_batch_sizes)
    if opts.model_parallel_size > 1 and opts.version != 0.2:
        raise ElasticityError(
            f"elasticity version {opts.version} does not support model parallelism "
            f"(model_parallel_size {opts.model_parallel_size}); use version 0.2"
        )
    own = False
    if opts.version == 0.1:
        batch, valid = _plan_v01(
            micro_batches,
            opts.max_train_batch_size,
            opts.min_gpus,
            opts.max_gpus,
            opts.prefer_larger_batch,
        )
    elif opts.version == 0.2:
        if world_size <= 0:
            raise ElasticityError(
                "elasticity version 0.2 plans for the current world size: give one "
                "(zerotrain elastic-plan --world-size N)"
            )
        batch, valid, own = _plan_v02(opts, world_size)
    else:
        raise ElasticityError(
            f"elasticity.version {opts.version} is not supported; allowed: 0.1, 0.2"
        )
    if not valid:
        raise ElasticityError(
            f"no world size in [{opts.min_gpus}, {opts.max_gpus}] can split any global batch "
            f"up to {opts.max_train_batch_size} into micro-batches of {micro_batches}"
        )
    if world_size <= 0:
        return ElasticPlan(batch, tuple(valid))
    if world_size not in valid:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} is not valid for the elastic plan (global batch "
            f"{batch}); valid world sizes: {valid}"
        )
    micro = micro_batch_for(batch, world_size, opts)
    return ElasticPlan(batch, tuple(valid), world_size, micro, own)


def micro_batch_for(batch: int, world_size: int, opts: ElasticOptions) -> int:
    """The largest of the micro-batch sizes that splits ``batch`` over ``world_size`` ranks
    into whole accumulation steps."""
    for micro in sorted(set(opts.micro_batch_sizes), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityIncompatibleWorldSize(
        f"no micro-batch size of {list(opts.micro_batch_sizes)} splits the global batch "
        f"{batch} over {world_size} ranks"
    )
