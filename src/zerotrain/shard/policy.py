"""The ZeRO stage as data: which model states are partitioned across data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ZeroPolicy:
    """What one ZeRO stage partitions. There are no stage-named classes: code reads these flags.

    * stage 0: nothing (plain data parallelism; gradients all-reduced);
    * stage 1: optimizer states and fp32 master weights;
    * stage 2: + gradients (reduce-scattered during backward);
    * stage 3: + parameters (gathered around each use, released after).
    """

    stage: int
    shard_optimizer: bool
    shard_gradients: bool
    shard_parameters: bool

    @classmethod
    def for_stage(cls, stage: int) -> ZeroPolicy:
        """The policy for ZeRO ``stage`` (0-3)."""
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        return cls(stage, stage >= 1, stage >= 2, stage >= 3)
