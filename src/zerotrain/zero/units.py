"""Splitting a model's parameters into units: stages 0-2 bucket the trainable parameters;
stage 3 makes one unit per block of the model (``build_module_units``).

Gradients become ready roughly in reverse order of parameter registration (the last layer's
first), so parameters are bucketed in that order: the first unit fills early in backward and
its communication overlaps the rest, and units complete one after another. Inside a unit the
parameters are laid out group by group, so each optimizer group is one contiguous range and
the optimizer steps it as one tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.comm.buckets import plan_buckets
from zerotrain.comm.collectives import Communicator
from zerotrain.config.policies import GradReducePolicy, PrecisionPolicy
from zerotrain.shard.layout import FlatLayout
from zerotrain.shard.staging import StagingPool
from zerotrain.shard.storage import StatePlacement
from zerotrain.shard.unit import ShardedUnit
from zerotrain.zero.module_units import plan_module_units
from zerotrain.zero.policy import ZeroPolicy

# The full value of a parameter that holds none yet (built by ``zerotrain.zero.Init``).
ValueLookup = Callable[[nn.Parameter], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TrainableParam:
    """A parameter that receives gradients.

    ``position`` is its index in ``model.named_parameters()`` (also its id in per-parameter
    bookkeeping); ``group_index`` its optimizer param group (None when the optimizer does not
    update it: its gradient is still averaged, as plain DDP would).
    """

    fqn: str
    param: nn.Parameter
    group_index: int | None
    position: int


def _group_major(bucket: list[TrainableParam]) -> list[TrainableParam]:
    # Parameters outside every group go last, where no optimizer piece covers them.
    return sorted(bucket, key=lambda e: (e.group_index is None, e.group_index or 0, -e.position))


AUTO_BUCKET_MIN = 1_000_000
AUTO_BUCKET_MAX = 25_000_000


def auto_bucket_numel(total_numel: int, device: torch.device, zero: ZeroPolicy) -> int:
    """The bucket size used when ``reduce_bucket_size`` is not set.

    On GPUs an eighth of the model, within [1M, 25M] elements, so reductions overlap
    backward (smaller buckets cost more calls than they save; 25M fp32 elements = 100 MB).
    On CPUs the ranks' compute already occupies every core, so overlap buys nothing and each
    extra collective costs a round trip: the whole model is one bucket, except at stage 2,
    where the bucket bounds gradient staging memory (a quarter of the model, two halves).
    """
    if device.type == "cpu" and not zero.shard_gradients:
        return max(total_numel, 1)
    share = 4 if device.type == "cpu" else 8
    return min(AUTO_BUCKET_MAX, max(AUTO_BUCKET_MIN, total_numel // share))


@dataclass(frozen=True)
class UnitPlan:
    """What one unit will hold, before it is built: its parameters in layout order, each
    one's name, optimizer group, model-wide position and whether it trains."""

    members: list[tuple[str, nn.Parameter]]
    groups: list[int | None]
    positions: list[int]
    trainable: list[bool]
    label: str | None = None


def _make_units(
    plans: Sequence[UnitPlan],
    comm: Communicator,
    zero: ZeroPolicy,
    reduce: GradReducePolicy,
    precision: PrecisionPolicy,
    staging_buffers: int,
    values: ValueLookup | None,
    placement: StatePlacement | None,
    master_on_host: bool,
    pad_multiple: int = 1,
) -> tuple[list[ShardedUnit], list[StagingPool]]:
    """The one place units are built, for every stage: a layout per plan, the staging
    pools the units share (stages 2-3: one per reduction dtype and device, sized for its
    largest unit, with ``staging_buffers`` buffers), then each unit in plan order.
    ``placement`` decides where each unit's states live as it is built (offload moves them
    to swap files before the next unit is built; None: in memory). Every unit's buffer is
    padded to a multiple of ``pad_multiple`` as well as of the ranks sharding it: the 1-bit
    all-reduce cuts buffers into equal chunks of whole bytes of signs."""
    world = comm.world_size if zero.shard_optimizer else 1
    align = math.lcm(pad_multiple, world) // world
    layouts = [
        FlatLayout.pack([(n, tuple(p.shape)) for n, p in plan.members], world, align)
        for plan in plans
    ]

    def staging_key(plan: UnitPlan) -> tuple[torch.dtype, torch.device]:
        param = plan.members[0][1]
        # Staging holds gradients in the dtype they are reduced in; stage 3 gathers
        # parameters onto the communicator's device.
        device = comm.device if zero.shard_parameters else param.device
        return precision.resolve(param.dtype)[2], device

    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    if zero.shard_gradients:
        for plan, layout in zip(plans, layouts, strict=True):
            key = staging_key(plan)
            sizes[key] = max(sizes.get(key, 0), layout.padded_numel)
    pools = {
        key: StagingPool(numel, key[0], key[1], count=staging_buffers)
        for key, numel in sizes.items()
    }
    units = []
    for index, (plan, layout) in enumerate(zip(plans, layouts, strict=True)):
        params = [p for _, p in plan.members]
        source = functools.partial(_value_of, values, params) if values is not None else None
        unit = ShardedUnit(
            index,
            layout,
            params,
            plan.groups,
            plan.positions,
            comm,
            zero,
            reduce,
            pools.get(staging_key(plan)),
            trainable=plan.trainable,
            label=plan.label,
            values=source,
            precision=precision,
            master_on_host=master_on_host,
            placement=placement,
        )
        units.append(unit)
    return units, list(pools.values())


def build_units(
    trainable: Sequence[TrainableParam],
    bucket_numel: int | None,
    comm: Communicator,
    zero: ZeroPolicy,
    reduce: GradReducePolicy,
    precision: PrecisionPolicy | None = None,
    placement: StatePlacement | None = None,
    master_on_host: bool = False,
    isolate: Sequence[str] = (),
    pad_multiple: int = 1,
) -> tuple[list[ShardedUnit], list[StagingPool]]:
    """Stages 0-2: pack ``trainable`` into buckets, returned in the order their gradients
    are reduced, with the staging pools they share (stage 2; one per dtype).

    ``isolate``: name prefixes (module paths ending in "."); the parameters under each form
    a unit of their own, reduced last, whatever the bucket size. Two models whose isolated
    modules are alike then lay those parameters out identically in one unit each, so their
    reduced gradient slices line up element for element (pipeline stages holding copies of
    a tied embedding sum them slice by slice)."""
    precision = precision or PrecisionPolicy()
    isolated: dict[str, list[TrainableParam]] = {prefix: [] for prefix in isolate}
    by_dtype: dict[tuple[torch.dtype, torch.device], list[TrainableParam]] = {}
    for entry in trainable:
        prefix = next((p for p in isolate if entry.fqn.startswith(p)), None)
        if prefix is not None:
            isolated[prefix].append(entry)
            continue
        dtype = precision.compute or entry.param.dtype
        by_dtype.setdefault((dtype, entry.param.device), []).append(entry)

    if bucket_numel is None and trainable:
        total = sum(e.param.numel() for e in trainable)
        bucket_numel = auto_bucket_numel(total, trainable[0].param.device, zero)
    bucket_numel = bucket_numel or 0
    # Stage 2 stages gradients in two buffers (one reduction in flight while the next unit
    # fills); half-size units keep that staging memory within one reduce_bucket_size.
    unit_numel = bucket_numel // 2 if zero.shard_gradients and reduce.overlap else bucket_numel
    buckets: list[list[TrainableParam]] = []
    for entries in by_dtype.values():
        entries = sorted(entries, key=lambda e: -e.position)
        for members in plan_buckets([e.param.numel() for e in entries], unit_numel):
            buckets.append(_group_major([entries[i] for i in members]))
    # A bucket is complete when its earliest-registered parameter gets its gradient (the last
    # one backward reaches); reduce buckets in that order so none waits behind a later one.
    buckets.sort(key=lambda b: -min(e.position for e in b))
    for prefix in sorted(isolated):
        if isolated[prefix]:
            buckets.append(_group_major(isolated[prefix]))
    plans = [
        UnitPlan(
            [(e.fqn, e.param) for e in bucket],
            [e.group_index for e in bucket],
            [e.position for e in bucket],
            [True] * len(bucket),
        )
        for bucket in buckets
    ]
    count = 2 if reduce.overlap else 1
    return _make_units(
        plans, comm, zero, reduce, precision, count, None, placement, master_on_host, pad_multiple
    )


def build_module_units(
    model: nn.Module,
    trainable: Sequence[TrainableParam],
    unit_classes: Sequence[str] | None,
    comm: Communicator,
    zero: ZeroPolicy,
    reduce: GradReducePolicy,
    values: ValueLookup | None = None,
    precision: PrecisionPolicy | None = None,
    placement: StatePlacement | None = None,
    master_on_host: bool = False,
) -> tuple[list[ShardedUnit], list[StagingPool], list[nn.Module]]:
    """Stage 3: one unit per block of the model plus the root unit (see
    ``zero/module_units.py``), returned in the order their gradients are reduced (the last
    block first, the root last), with the staging pools and each unit's module.

    Frozen parameters are partitioned and gathered with their unit but get no gradient.
    """
    precision = precision or PrecisionPolicy()
    blocks, root = plan_module_units(model, unit_classes)
    planned = [*reversed(blocks), *([root] if root is not None else [])]
    tags = {id(e.param): e for e in trainable}
    positions = {id(p): k for k, (_, p) in enumerate(model.named_parameters())}

    def order(entry: tuple[str, nn.Parameter]) -> tuple[bool, int, int]:
        tag = tags.get(id(entry[1]))
        group = tag.group_index if tag is not None else None
        return (group is None, group or 0, positions[id(entry[1])])

    plans = []
    for planned_unit in planned:
        members = sorted(planned_unit.params, key=order)
        dtypes = {p.dtype for _, p in members}
        if len(dtypes) != 1 and precision.compute is None:
            raise ValueError(
                f"stage 3 gathers each unit as one buffer, but the parameters of "
                f"'{planned_unit.label}' mix dtypes {sorted(map(str, dtypes))}; cast the "
                "model to one dtype"
            )
        plans.append(
            UnitPlan(
                members,
                [tags[id(p)].group_index if id(p) in tags else None for _, p in members],
                [positions[id(p)] for _, p in members],
                [id(p) in tags for _, p in members],
                planned_unit.label,
            )
        )
    # The root unit's early gradients (final norm, head) are staged for the whole backward
    # pass while the blocks' come and go: two buffers, so the blocks never wait for a third.
    units, pools = _make_units(
        plans, comm, zero, reduce, precision, 2, values, placement, master_on_host
    )
    return units, pools, [p.module for p in planned]


def _value_of(values: ValueLookup, params: Sequence[nn.Parameter], index: int) -> torch.Tensor:
    return values(params[index])
