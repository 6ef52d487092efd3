"""Where a training job keeps each piece of model state, in the checkpoint's coordinates.

A checkpoint addresses state by parameter name and a region of the global tensor; the job
keeps it in units (flat buffers, whole or sharded) and optimizer tensors (flat pieces of a
unit, or the model's own parameters for a user optimizer at stage 0). This module maps
between the two, for saving and for loading alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.checkpoint.boxes import Box, Region
from zerotrain.checkpoint.state import ShardedStateView, TrainState
from zerotrain.parallel.tensor import TensorSplit, tensor_splits
from zerotrain.shard.unit import ShardedUnit


@dataclass(frozen=True, slots=True)
class Span:
    """Elements ``[lo, hi)`` of this rank's flattened parameter ``name`` sit at offset
    ``at`` of a flat range."""

    name: str
    lo: int
    hi: int
    at: int


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor the optimizer keeps state for: ``tensor`` covers elements
    ``[start, start + tensor.numel())`` of ``unit``'s flat buffer."""

    tensor: torch.Tensor
    unit: ShardedUnit
    start: int

    @property
    def end(self) -> int:
        """One past the slot's last element in the unit's buffer."""
        return self.start + self.tensor.numel()


class Geometry:
    """Where each of this rank's tensors sits in its global tensor.

    A tensor-parallel parameter (``TensorSplit``) holds blocks of the global tensor: one
    row or column block, or, for a packed projection, its block of each part (concatenated
    along dimension 0, so the local flattening is the blocks' flattenings in turn). Every
    other tensor is whole. Spans of a local flattening become regions of global boxes here,
    so that a checkpoint saved at one tensor-parallel degree loads at any other.
    """

    def __init__(self, splits: dict[str, TensorSplit]) -> None:
        self.splits = splits

    @classmethod
    def of(cls, module: nn.Module) -> Geometry:
        """The geometry of ``module``'s parameters (their tensor-parallel splits)."""
        return cls(tensor_splits(module))

    def global_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the global tensor ``name`` (``local_shape`` on this rank)."""
        split = self.splits.get(name)
        return tuple(local_shape) if split is None else split.full_shape

    def places(self, span: Span, local_shape: tuple[int, ...]) -> list[tuple[Span, Region]]:
        """``span`` of this rank's ``span.name`` (of ``local_shape``) as pieces, each inside
        one global box: the piece's span (``at`` moved along) and its global region."""
        split = self.splits.get(span.name)
        if split is None:
            return [(span, Region(Box.whole(tuple(local_shape)), span.lo, span.hi))]
        found = []
        start = 0
        for offsets, lengths in split.boxes():
            box = Box(offsets, lengths)
            lo, hi = max(span.lo, start), min(span.hi, start + box.numel)
            if lo < hi:
                piece = Span(span.name, lo, hi, span.at + lo - span.lo)
                found.append((piece, Region(box, lo - start, hi - start)))
            start += box.numel
        return found


def canonical_names(model: nn.Module) -> dict[int, str]:
    """``id(param)`` -> the parameter's name in ``model.named_parameters()``."""
    return {id(p): name for name, p in model.named_parameters()}


def unit_names(unit: ShardedUnit, names: dict[int, str]) -> list[str]:
    """The name of each parameter of ``unit``, in its layout order."""
    return [names[id(p)] for p in unit.buffer.params]


def spans(unit: ShardedUnit, names: list[str], a: int, b: int) -> list[Span]:
    """The parameter ranges inside ``[a, b)`` of ``unit``'s buffer (padding skipped)."""
    found = []
    for spec, name in zip(unit.buffer.layout.params, names, strict=True):
        lo, hi = max(a, spec.start), min(b, spec.end)
        if lo < hi:
            found.append(Span(name, lo - spec.start, hi - spec.start, lo - a))
    return found


def write_range(unit: ShardedUnit, rank: int, world_size: int) -> tuple[int, int]:
    """The part of the unit this rank writes (``rank`` of the ``world_size`` ranks sharing
    it). Sharded units: the shard; units every rank holds whole are split evenly, so that
    each rank writes 1/N of them."""
    if unit.zero.shard_optimizer:
        a, b = unit.owned
    else:
        numel = unit.buffer.layout.numel
        chunk = -(-numel // world_size)
        a, b = min(numel, rank * chunk), min(numel, (rank + 1) * chunk)
    return a, min(b, unit.buffer.layout.numel)


def param_values(unit: ShardedUnit, a: int, b: int) -> torch.Tensor:
    """The parameter values (as held, compute dtype) of ``[a, b)``, inside the held range."""
    return unit.buffer.owned_slice(a, b)


def optimizer_slots(state: TrainState) -> list[Slot]:
    """Every tensor this rank's optimizer keeps state for."""
    optimizer = state.optimizer
    if optimizer is None:
        return []
    slots = []
    units = state.sharded.units
    if state.steps_model_params:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for unit in units:
            for param, spec in zip(unit.buffer.params, unit.buffer.layout.params, strict=True):
                if id(param) in stepped:
                    slots.append(Slot(param, unit, spec.start))
    else:
        for unit in units:
            slots += [Slot(piece.param, unit, piece.start) for piece in unit.pieces]
    return slots


def loose_parameters(model: nn.Module, sharded: ShardedStateView) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside every unit (frozen ones at stages 0-2), by name."""
    managed = sharded.managed()
    return [(n, p) for n, p in model.named_parameters() if id(p) not in managed]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in the state dict (not ``persistent=False`` ones), by name."""
    params = {id(p) for p in model.parameters()}
    return [
        (name, value)
        for name, value in model.state_dict(keep_vars=True).items()
        if id(value) not in params and isinstance(value, torch.Tensor)
    ]


def group_members(state: TrainState) -> list[list[str]]:
    """The names of the parameters in each of the optimizer's param groups that this rank
    holds, in the model's order (a pipeline stage holds its own layers' only)."""
    names_by_id = canonical_names(state.module)
    order = {name: i for i, name in enumerate(names_by_id.values())}
    groups: dict[int, list[str]] = {}
    for unit in state.sharded.units:
        for param, group in zip(unit.buffer.params, unit.groups, strict=True):
            if group is not None:
                groups.setdefault(group, []).append(names_by_id[id(param)])
    count = len(state.optimizer.param_groups) if state.optimizer is not None else 0
    return [sorted(groups.get(g, []), key=order.__getitem__) for g in range(count)]
