"""Where an engine keeps each piece of model state, in the checkpoint's coordinates.

A checkpoint addresses state by parameter name and a range of the flattened parameter; the
engine keeps it in units (flat buffers, whole or sharded) and optimizer tensors (flat pieces
of a unit, or the model's own parameters for a user optimizer at stage 0). This module maps
between the two, for saving and for loading alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zerotrain.shard.unit import ShardedUnit

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine


@dataclass(frozen=True, slots=True)
class Span:
    """Elements ``[lo, hi)`` of flattened parameter ``name`` sit at offset ``at`` of a flat
    range."""

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
    """The part of the unit this rank writes. Sharded units: the shard; units every rank
    holds whole are split evenly, so that each rank writes 1/N of them."""
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


def optimizer_slots(engine: Engine) -> list[Slot]:
    """Every tensor this rank's optimizer keeps state for."""
    optimizer = engine.optimizer
    if optimizer is None:
        return []
    slots = []
    if engine._steps_model_params:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for unit in engine.strategy.units:
            for param, spec in zip(unit.buffer.params, unit.buffer.layout.params, strict=True):
                if id(param) in stepped:
                    slots.append(Slot(param, unit, spec.start))
    else:
        for unit in engine.strategy.units:
            slots += [Slot(piece.param, unit, piece.start) for piece in unit.pieces]
    return slots


def loose_parameters(engine: Engine) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside every unit (frozen ones at stages 0-2), by name."""
    managed = engine.strategy.managed()
    return [(n, p) for n, p in engine.module.named_parameters() if id(p) not in managed]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in the state dict (not ``persistent=False`` ones), by name."""
    params = {id(p) for p in model.parameters()}
    return [
        (name, value)
        for name, value in model.state_dict(keep_vars=True).items()
        if id(value) not in params and isinstance(value, torch.Tensor)
    ]
