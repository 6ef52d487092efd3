"""Batch-size arithmetic: train_batch_size = micro_batch x accumulation_steps x dp_world_size.

Any two of the three determine the third (one alone is enough when the other defaults to 1).
Pure functions, no torch: unit-tested exhaustively.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.config.errors import ConfigError, ConfigProblem


@dataclass(frozen=True, slots=True)
class BatchSizes:
    """Resolved batch sizes; ``train_batch_size == micro * accumulation * dp_world_size``."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    dp_world_size: int


def _fail(message: str) -> ConfigError:
    return ConfigError([ConfigProblem("train_batch_size", message)])


def resolve_batch_sizes(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    dp_world_size: int,
) -> BatchSizes:
    """Fill in the missing batch sizes, or explain with the arithmetic why they cannot agree.

    Args:
        train_batch_size: samples per optimizer step across all ranks, or None.
        micro_batch_size: samples per forward/backward on one rank, or None.
        gradient_accumulation_steps: micro-steps per optimizer step, or None.
        dp_world_size: number of data-parallel ranks.

    Raises:
        ConfigError: when the values are inconsistent or too few are given.
    """
    if dp_world_size < 1:
        raise ValueError(f"dp_world_size must be >= 1, got {dp_world_size}")
    tbs, mbs, gas, n = (
        train_batch_size,
        micro_batch_size,
        gradient_accumulation_steps,
        dp_world_size,
    )
    names = (
        f"train_micro_batch_size_per_gpu ({mbs}) x gradient_accumulation_steps ({gas}) "
        f"x data-parallel world size ({n})"
    )
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * n:
            raise _fail(f"train_batch_size ({tbs}) != {names} = {mbs * gas * n}")
        return BatchSizes(tbs, mbs, gas, n)
    if tbs is not None and mbs is not None:
        if tbs % (mbs * n) != 0:
            raise _fail(
                f"train_batch_size ({tbs}) is not a multiple of train_micro_batch_size_per_gpu "
                f"({mbs}) x data-parallel world size ({n}) = {mbs * n}, so "
                "gradient_accumulation_steps would not be a whole number"
            )
        return BatchSizes(tbs, mbs, tbs // (mbs * n), n)
    if tbs is not None:
        gas = 1 if gas is None else gas
        if tbs % (gas * n) != 0:
            raise _fail(
                f"train_batch_size ({tbs}) is not a multiple of gradient_accumulation_steps "
                f"({gas}) x data-parallel world size ({n}) = {gas * n}, so "
                "train_micro_batch_size_per_gpu would not be a whole number"
            )
        return BatchSizes(tbs, tbs // (gas * n), gas, n)
    if mbs is not None:
        gas = 1 if gas is None else gas
        return BatchSizes(mbs * gas * n, mbs, gas, n)
    raise _fail(
        "set train_batch_size or train_micro_batch_size_per_gpu (with "
        "gradient_accumulation_steps alone the batch size is unknown)"
        if gas is not None
        else "no batch size given: set train_batch_size or train_micro_batch_size_per_gpu"
    )
