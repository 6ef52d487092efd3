"""Splitting a model's trainable parameters into units (stages 0-2: buckets of the model).

Gradients become ready roughly in reverse order of parameter registration (the last layer's
first), so parameters are packed in that order: the first bucket fills early in backward and
its communication overlaps the rest. Each unit holds parameters of one optimizer group and
one dtype, so the optimizer can update its flat buffer with the group's settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import GradReducePolicy
from zerotrain.shard.flat_buffer import FlatParamBuffer
from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.unit import ShardedUnit
from zerotrain.zero.policy import ZeroPolicy


@dataclass(frozen=True, slots=True)
class TrainableParam:
    """A parameter that receives gradients.

    ``position`` is its index in ``model.named_parameters()``; ``group_index`` its optimizer
    param group (None when the optimizer does not update it: its gradient is still averaged,
    as plain DDP would).
    """

    fqn: str
    param: nn.Parameter
    group_index: int | None
    position: int


def build_units(
    trainable: Sequence[TrainableParam],
    bucket_numel: int,
    comm: Communicator,
    zero: ZeroPolicy,
    reduce: GradReducePolicy,
) -> list[ShardedUnit]:
    """Pack ``trainable`` into units, returned in the order their gradients are reduced."""
    by_kind: dict[tuple[int, str, str], list[TrainableParam]] = {}
    for entry in trainable:
        group = -1 if entry.group_index is None else entry.group_index
        key = (group, str(entry.param.dtype), str(entry.param.device))
        by_kind.setdefault(key, []).append(entry)

    buckets: list[list[TrainableParam]] = []
    for entries in by_kind.values():
        entries = sorted(entries, key=lambda e: -e.position)
        for members in plan_buckets([e.param.numel() for e in entries], bucket_numel):
            buckets.append([entries[i] for i in members])
    # A bucket is complete when its earliest-registered parameter gets its gradient (the last
    # one backward reaches); reduce buckets in that order so none waits behind a later one.
    buckets.sort(key=lambda b: -min(e.position for e in b))

    units: list[ShardedUnit] = []
    for index, bucket in enumerate(buckets):
        layout = FlatLayout.pack([(e.fqn, tuple(e.param.shape)) for e in bucket], world_size=1)
        buffer = FlatParamBuffer(layout, [e.param for e in bucket])
        units.append(ShardedUnit(index, buffer, bucket[0].group_index, comm, zero, reduce))
    return units
