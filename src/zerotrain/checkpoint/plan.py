"""What one rank writes: its tensors (one per unit and kind, plus whole loose parameters and
buffers where it is their writer) and the index that places each in global coordinates."""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.checkpoint import regions
from zerotrain.checkpoint.boxes import Region
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.state import TrainState
from zerotrain.config.policies import short_dtype_name


def _place(name: str, region: Region) -> dict[str, Any]:
    box = region.box
    return {
        "name": name,
        "offsets": list(box.offsets),
        "lengths": list(box.lengths),
        "lo": region.lo,
        "hi": region.hi,
    }


class ShardPlan:
    """The tensors one rank writes, and where each element of them belongs."""

    def __init__(
        self,
        file: str,
        shapes: dict[str, tuple[int, ...]],
        geometry: regions.Geometry | None = None,
    ) -> None:
        self.file = file
        self.shapes = shapes  # global shape of every tensor this rank holds, by name
        # Where tensor-parallel slices sit in their global tensors (default: all whole).
        self.geometry = geometry or regions.Geometry({})
        self.tensors: dict[str, torch.Tensor] = {}
        self.fragments: list[dict[str, Any]] = []
        self.scalars: list[dict[str, Any]] = []

    def places(self, spans: list[regions.Span]) -> list[tuple[regions.Span, Region]]:
        """The spans as pieces, each with its global region (a tensor-parallel span may
        cover several blocks of the global tensor)."""
        return [
            piece for s in spans for piece in self.geometry.places(s, self._local_shape(s.name))
        ]

    def _local_shape(self, name: str) -> tuple[int, ...]:
        split = self.geometry.splits.get(name)
        return self.shapes[name] if split is None else split.local_shape

    def add(self, key: str, tensor: torch.Tensor, kind: str, spans: list[regions.Span]) -> None:
        """Store flat ``tensor`` under ``key``; ``spans`` say which elements it holds."""
        self.tensors[key] = tensor
        for span, region in self.places(spans):
            self.fragments.append(
                {"kind": kind, "shape": list(self.shapes[span.name])}
                | _place(span.name, region)
                | {"file": self.file, "key": key, "offset": span.at}
            )

    def add_whole(self, key: str, tensor: torch.Tensor, kind: str, name: str) -> None:
        """Store all of ``tensor`` (a loose parameter or buffer)."""
        self.add(key, tensor.reshape(-1), kind, [regions.Span(name, 0, tensor.numel(), 0)])

    def add_scalars(self, spans: list[regions.Span], values: dict[str, Any]) -> None:
        """Scalar optimizer states of the optimizer tensor covering ``spans``."""
        places = [_place(s.name, r) for s, r in self.places(spans)]
        self.scalars.append({"spans": places, "values": values})


def _scalar(name: str, value: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"value": value.item(), "dtype": short_dtype_name(value.dtype)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"value": float(value), "dtype": None}
    raise CheckpointError(
        f"optimizer state '{name}' of {type(optimizer).__name__} is a "
        f"{type(value).__name__} of shape {getattr(value, 'shape', '?')}; checkpoints store "
        "element-wise tensors and scalars only"
    )


def plan_units(state: TrainState, plan: ShardPlan, names: dict[int, str]) -> None:
    """Add this rank's share of every unit: parameters, masters, optimizer states."""
    data = state.placement.data
    slots_by_unit: dict[int, list[regions.Slot]] = {}
    for slot in regions.optimizer_slots(state):
        slots_by_unit.setdefault(slot.unit.index, []).append(slot)
    optimizer = state.optimizer
    opt_state = optimizer.state if optimizer is not None else {}
    for unit in state.sharded.units:
        unit_names = regions.unit_names(unit, names)
        a, b = regions.write_range(unit, data.rank, data.world_size)
        if a >= b:
            continue
        u = unit.index
        spans = regions.spans(unit, unit_names, a, b)
        plan.add(f"u{u}.param", regions.param_values(unit, a, b), "param", spans)
        if unit.master is not None:
            mlo, mhi = unit.master_range
            lo, hi = max(a, mlo), min(b, mhi)
            if lo < hi:
                master = unit.master[lo - mlo : hi - mlo]
                plan.add(f"u{u}.master", master, "master", regions.spans(unit, unit_names, lo, hi))
        for j, slot in enumerate(slots_by_unit.get(u, [])):
            lo, hi = max(a, slot.start), min(b, slot.end)
            if lo >= hi:
                continue
            slot_spans = regions.spans(unit, unit_names, lo, hi)
            scalars: dict[str, Any] = {}
            for name, value in opt_state.get(slot.tensor, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == slot.tensor.shape:
                    flat = value.reshape(-1)[lo - slot.start : hi - slot.start]
                    plan.add(f"u{u}.s{j}.{name}", flat, f"optim.{name}", slot_spans)
                elif optimizer is not None:  # always: state exists only with an optimizer
                    scalars[name] = _scalar(name, value, optimizer)
            if scalars:
                plan.add_scalars(slot_spans, scalars)


def model_tables(
    state: TrainState, geometry: regions.Geometry
) -> tuple[dict[str, Any], dict[str, str]]:
    """This rank's ``tensors`` (state-dict order, global shapes) and ``aliases`` tables:
    what it holds of the model. The manifest holds the union over every rank."""
    model = state.module
    params = {id(p): (name, p) for name, p in model.named_parameters()}
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for unit in state.sharded.units:
        for param, spec, dtype in zip(
            unit.buffer.params, unit.buffer.layout.params, unit.model_dtypes, strict=True
        ):
            name = params[id(param)][0]
            shapes[id(param)] = (geometry.global_shape(name, tuple(spec.shape)), dtype)
    for name, param in model.named_parameters():
        if id(param) not in shapes:  # outside every unit (frozen): split like the rest
            own = state.original_dtype(param)
            shapes[id(param)] = (geometry.global_shape(name, tuple(param.shape)), own)
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        canonical = params[id(value)][0] if id(value) in params else first_name.get(id(value))
        if canonical is not None and canonical != key:
            aliases[key] = canonical
            continue
        first_name[id(value)] = key
        shape, own = shapes.get(id(value), (tuple(value.shape), state.original_dtype(value)))
        tensors[key] = {
            "kind": "param" if id(value) in params else "buffer",
            "shape": list(shape),
            "dtype": short_dtype_name(own or value.dtype),
            "trainable": bool(value.requires_grad) if id(value) in params else False,
        }
    return tensors, aliases


def build_plan(state: TrainState, file: str) -> tuple[ShardPlan, dict[str, Any], dict[str, str]]:
    """Everything this rank writes into ``file``, with its model tables."""
    geometry = regions.Geometry.of(state.module)
    tables = model_tables(state, geometry)
    shapes = {name: tuple(info["shape"]) for name, info in tables[0].items()}
    plan = ShardPlan(file, shapes, geometry)
    plan_units(state, plan, regions.canonical_names(state.module))
    placement = state.placement
    where = placement.topology.coordinates(placement.global_rank)
    # Loose parameters and buffers are replicated over the ranks ZeRO shards across: the
    # first of those writes them (on every pipeline stage and tensor rank, each its own).
    if where.data == 0 and where.sequence == 0:
        for name, param in regions.loose_parameters(state.module, state.sharded):
            plan.add_whole(f"loose.{name}", param.detach(), "param", name)
        for name, buffer in regions.persistent_buffers(state.module):
            if name in tables[0]:
                plan.add_whole(f"buffer.{name}", buffer.detach(), "buffer", name)
    return plan, tables[0], tables[1]
