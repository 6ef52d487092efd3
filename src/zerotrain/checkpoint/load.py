"""``load_checkpoint``: fill a job's units, optimizer and counters from a checkpoint written
by any grid of ranks at any ZeRO stage and precision (format 1 or 2).

Each rank reads only what it keeps authoritatively (its shard of each unit; everything at
stage 0), by parameter name and region of the global tensor: the intersection of each saved
fragment with the wanted region (``checkpoint/boxes.py``). Stages 1-2 then all-gather
parameters as after an optimizer step. The manifest (and ``latest``) are verified by every
rank, the other files (size, CRC-32) by a share of the ranks each, before anything is read;
every rank raises if any is bad. A DeepSpeed checkpoint is read through the same steps, its
files described as an in-memory manifest (``deepspeed_import.py``, ``deepspeed_reader.py``).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint import rank_local, regions, rng
from zerotrain.checkpoint.boxes import Region, shared_count
from zerotrain.checkpoint.deepspeed_import import (
    is_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from zerotrain.checkpoint.deepspeed_reader import ImportedReader
from zerotrain.checkpoint.directory import locate
from zerotrain.checkpoint.dtype_names import dtype_from_name
from zerotrain.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from zerotrain.checkpoint.manifest import Manifest
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.checkpoint.save import agree, check_same_directory
from zerotrain.checkpoint.state import Counters, TrainState
from zerotrain.optim.base import GROUP_LAYOUT_KEYS
from zerotrain.utils.invariant import invariant
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class LoadReport:
    """What ``load_checkpoint`` matched: model entries absent from the checkpoint
    (``missing``, kept as they were) and checkpoint entries the model lacks (``unexpected``)."""

    path: str = ""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _model_shapes(state: TrainState, geometry: regions.Geometry) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor this rank holds, by name."""
    shapes = {}
    names_by_id = regions.canonical_names(state.module)
    for unit in state.sharded.units:
        names = regions.unit_names(unit, names_by_id)
        for name, spec in zip(names, unit.buffer.layout.params, strict=True):
            shapes[name] = geometry.global_shape(name, tuple(spec.shape))
    for name, param in regions.loose_parameters(state.module, state.sharded):
        shapes[name] = geometry.global_shape(name, tuple(param.shape))
    for name, buffer in regions.persistent_buffers(state.module):
        shapes.setdefault(name, tuple(buffer.shape))
    return shapes


def _match_model(state: TrainState, manifest: Manifest, path: Path, strict: bool) -> LoadReport:
    ours = _model_shapes(state, regions.Geometry.of(state.module))
    aliases = set(manifest.aliases)
    theirs = {n: tuple(t.shape) for n, t in manifest.tensors.items()}
    wrong = [
        f"{n}: checkpoint {list(theirs[n])}, model {list(ours[n])}"
        for n in theirs  # in state-dict order
        if n in ours and theirs[n] != ours[n]
    ]
    missing = [n for n in ours if n not in theirs and n not in aliases]
    # Pipeline stages each hold part of the model: a checkpoint tensor is unexpected only if
    # no rank of the job holds it, and every rank takes each decision alike (one raising
    # alone would leave the others waiting in the load's collectives).
    held = [float(n in ours) for n in theirs] + [float(len(missing)), float(len(wrong))]
    world = state.placement.world
    counts = torch.tensor(held, dtype=torch.float64, device=world.device)
    world.all_reduce(counts, purpose="control")
    *held_by, missing_anywhere, wrong_anywhere = counts.tolist()
    if wrong_anywhere:
        shown = "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else "")
        raise IncompatibleCheckpointError(
            f"{path} holds a different model: shapes differ for {int(wrong_anywhere)} "
            f"tensor(s)" + (f": {shown}" if wrong else " (on other ranks; see their errors)")
        )
    unexpected = [n for n, count in zip(theirs, held_by, strict=True) if count == 0]
    report = LoadReport(str(path), missing=missing, unexpected=unexpected)
    if strict and (missing_anywhere or report.unexpected):
        elsewhere = int(missing_anywhere) - len(missing)
        raise IncompatibleCheckpointError(
            f"{path} does not match the model (pass strict=False to load what matches): "
            f"missing from the checkpoint {report.missing[:10]}"
            + (f" ({int(missing_anywhere)} over every rank)" if elsewhere else "")
            + f", not in the model {report.unexpected[:10]}"
        )
    if report.missing or report.unexpected:
        log.warning(
            "loading %s with strict=False: %d model tensor(s) not in the checkpoint keep their "
            "values (%s); %d checkpoint tensor(s) not in the model are ignored (%s)",
            path,
            len(report.missing),
            ", ".join(report.missing[:10]),
            len(report.unexpected),
            ", ".join(report.unexpected[:10]),
        )
    return report


def _read_span(
    reader: CheckpointReader,
    kind: str,
    source: str,
    places: list[tuple[regions.Span, Region]],
    out: torch.Tensor,
    *,
    partial: bool = False,
) -> int:
    """Fill ``out`` (one span of this rank's parameter, as ``places``: its pieces in global
    regions) from ``source``; returns how many elements were found."""
    first = places[0][0].at if places else 0
    found = 0
    for piece, region in places:
        part = out[piece.at - first : piece.at - first + piece.hi - piece.lo]
        found += reader.read_region_into(kind, source, region, part, partial=partial)
    return found


def _covers(
    reader: CheckpointReader, kind: str, source: str, places: list[tuple[regions.Span, Region]]
) -> bool:
    return all(reader.covers_region(kind, source, region) for _, region in places)


def _load_params(state: TrainState, reader: CheckpointReader) -> None:
    names_by_id = regions.canonical_names(state.module)
    geometry = regions.Geometry.of(state.module)
    units = state.sharded.units
    for unit in units:
        names = regions.unit_names(unit, names_by_id)
        shapes = {n: spec.shape for n, spec in zip(names, unit.buffer.layout.params, strict=True)}
        # What this rank keeps authoritatively: its shard, or everything when unsharded.
        a, b = unit.owned
        b = min(b, unit.buffer.layout.numel)
        with torch.no_grad():
            for span in regions.spans(unit, names, a, b):
                source = reader.stored_name(span.name)
                if source is None:
                    continue
                at = a + span.at
                out = regions.param_values(unit, at, at + span.hi - span.lo)
                places = geometry.places(span, shapes[span.name])
                # fp32 values come from the master copy where one was saved.
                use_master = out.dtype == torch.float32 and _covers(
                    reader, "master", source, places
                )
                kind = "master" if use_master else "param"
                _read_span(reader, kind, source, places, out)
            if unit.master is not None:
                mlo, mhi = unit.master_range
                for span in regions.spans(unit, names, mlo, mhi):
                    source = reader.stored_name(span.name)
                    if source is None:
                        continue
                    out = unit.master[span.at : span.at + span.hi - span.lo]
                    places = geometry.places(span, shapes[span.name])
                    kind = "master" if _covers(reader, "master", source, places) else "param"
                    _read_span(reader, kind, source, places, out)
                unit.publish()
    state.sharded.refresh_params()
    with torch.no_grad():
        for name, param in regions.loose_parameters(state.module, state.sharded):
            if (source := reader.stored_name(name)) is None:
                continue
            if name in geometry.splits:
                whole = regions.Span(name, 0, param.numel(), 0)
                places = geometry.places(whole, tuple(param.shape))
                kind = "master" if _covers(reader, "master", source, places) else "param"
                value = torch.empty(param.numel(), dtype=reader.dtype(kind, source) or param.dtype)
                _read_span(reader, kind, source, places, value)
                param.data.copy_(value.view(param.shape))
            else:
                param.data.copy_(reader.tensor(source, param.dtype))
        for name, buffer in regions.persistent_buffers(state.module):
            if (source := reader.stored_name(name)) is not None:
                buffer.data.copy_(reader.tensor(source, buffer.dtype))


def _slot_scalars(
    manifest: Manifest, wanted: list[tuple[str, Region]], where: str
) -> dict[str, tuple[float, str | None]]:
    """The scalar states (Adam's step) of a new optimizer tensor covering ``wanted``: the
    values saved for the tensors that covered the same elements (when they disagree, which
    happens only when some parameters skipped steps unused, the one covering most wins)."""
    invariant(manifest.optimizer is not None, f"{where}: scalars without optimizer states")
    votes: dict[str, Counter[tuple[float, str | None]]] = {}
    regions_by_name: dict[str, list[Region]] = {}
    for name, region in wanted:
        regions_by_name.setdefault(name, []).append(region)
    for saved in manifest.optimizer.scalars if manifest.optimizer is not None else []:
        shared = sum(
            shared_count(place.region(), region)
            for place in saved.spans
            for region in regions_by_name.get(place.name, [])
        )
        if shared:
            for key, scalar in saved.values.items():
                votes.setdefault(key, Counter())[scalar.value, scalar.dtype] += shared
    chosen = {}
    for key, counter in votes.items():
        if len(counter) > 1:
            log.debug("%s: saved '%s' values differ %s; using the most common", where, key, counter)
        chosen[key] = counter.most_common(1)[0][0]
    return chosen


def _load_optimizer(state: TrainState, reader: CheckpointReader) -> None:
    optimizer = state.optimizer
    info = reader.manifest.optimizer
    path = reader.path
    if optimizer is None:
        log.info("%s: this job has no optimizer; optimizer states not loaded", path)
        return
    if info is None:
        raise IncompatibleCheckpointError(
            f"{path} was saved without an optimizer; load it with load_optimizer_states=False"
        )
    if info.type != type(optimizer).__name__ or len(info.groups) != len(optimizer.param_groups):
        raise IncompatibleCheckpointError(
            f"{path} holds the states of {info.type} with {len(info.groups)} param group(s); "
            f"this job steps {type(optimizer).__name__} with {len(optimizer.param_groups)}: "
            "load with load_optimizer_states=False to take only the weights"
        )
    names_by_id = regions.canonical_names(state.module)
    geometry = regions.Geometry.of(state.module)
    kinds = sorted(k.removeprefix("optim.") for k in reader.kinds() if k.startswith("optim."))
    for slot in regions.optimizer_slots(state):
        names = regions.unit_names(slot.unit, names_by_id)
        shapes = dict(zip(names, (p.shape for p in slot.unit.buffer.layout.params), strict=True))
        spans = [
            (source, region, piece)
            for s in regions.spans(slot.unit, names, slot.start, slot.end)
            if (source := reader.stored_name(s.name)) is not None
            for piece, region in geometry.places(s, shapes[s.name])
        ]
        values: dict[str, Any] = {}
        for key in kinds:
            kind = f"optim.{key}"
            dtypes = [reader.dtype(kind, source) for source, _, _ in spans]
            dtype = next((d for d in dtypes if d is not None), None)
            if dtype is None:
                continue
            value = torch.zeros(slot.tensor.numel(), dtype=dtype, device=slot.tensor.device)
            for source, region, s in spans:
                out = value[s.at : s.at + s.hi - s.lo]
                reader.read_region_into(kind, source, region, out, partial=True)
            values[key] = value.view(slot.tensor.shape)
        if values:
            wanted = [(source, region) for source, region, _ in spans]
            for key, (number, dtype_name) in _slot_scalars(
                reader.manifest, wanted, str(path)
            ).items():
                values[key] = (
                    torch.tensor(
                        number, dtype=dtype_from_name(dtype_name), device=slot.tensor.device
                    )
                    if dtype_name is not None
                    else number
                )
            optimizer.state[slot.tensor] = values
        else:
            optimizer.state.pop(slot.tensor, None)
    for group, saved in zip(optimizer.param_groups, info.groups, strict=True):
        for key, value in saved.items():
            if key in GROUP_LAYOUT_KEYS:
                continue  # this rank's own layout (saved by older versions: rank 0's)
            if reader.foreign and key not in group:
                continue  # a setting of the other system's optimizer that this one lacks
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value


def _load_rank_local(state: TrainState, reader: CheckpointReader) -> None:
    """The optimizer's rank-local state, where the checkpoint's layout is this job's."""
    rank = state.placement.global_rank
    saved = reader.manifest.rank_local
    entry = saved[rank] if saved is not None and rank < len(saved) else None
    with torch.no_grad():
        rank_local.restore(
            state.optimizer,
            entry,
            lambda key: reader.rank_tensor(rank, key),
            str(reader.path),
            rank,
        )
        for unit in state.sharded.units:
            unit.publish()  # values the optimizer restored into fp32 masters (0/1 Adam's)


def _load_rng(state: TrainState, reader: CheckpointReader) -> None:
    manifest = reader.manifest
    placement = state.placement
    rank, world = placement.global_rank, placement.topology.world_size
    if world != manifest.world_size and rank == 0:
        log.warning(
            "%s was saved by %d rank(s), loaded by %d: ranks below %d resume their saved random "
            "states, the others keep theirs (dropout masks differ from the saved run anyway, as "
            "each rank sees different samples)",
            reader.path,
            manifest.world_size,
            world,
            min(world, manifest.world_size),
        )
    if rank >= manifest.world_size:
        return
    if not manifest.rng:
        if rank == 0:
            log.info("%s holds no random states; every rank keeps its own", reader.path)
        return
    tensors = {}
    for key in (rng.TORCH_KEY, rng.CUDA_KEY):
        value = reader.rank_tensor(rank, key)
        if value is not None:
            tensors[key] = value
    rng.restore(manifest.rng[rank], tensors, placement.device)


def _load_client_state(path: Path, manifest: Manifest) -> Any:
    if manifest.client_state is None:
        return None
    file = path / manifest.client_state
    try:
        return torch.load(file, weights_only=True)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{file} is missing from the checkpoint") from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"{file}: cannot be loaded ({exc})") from exc


def _open_verified(
    state: TrainState, load_dir: str | os.PathLike[str], tag: str | None, optimizer: bool
) -> CheckpointReader:
    """The checkpoint, its manifest verified on every rank and its files split among the
    ranks of the job; every rank raises if any check failed anywhere."""
    placement = state.placement
    world = placement.world
    check_same_directory(world, "load_dir", Path(load_dir))
    error: BaseException | None = None
    reader: CheckpointReader | None = None
    try:
        if is_deepspeed_checkpoint(Path(load_dir), tag):
            # DeepSpeed without ZeRO names its optimizer states by position in the groups.
            members = functools.partial(regions.group_members, state) if optimizer else None
            # No checksums to verify: DeepSpeed writes none (its files' structure is checked).
            reader = ImportedReader(read_deepspeed_checkpoint(Path(load_dir), tag, members))
        else:
            reader = CheckpointReader(*locate(load_dir, tag))
            files = sorted(reader.manifest.files)
            reader.verify(files[placement.global_rank :: placement.topology.world_size])
    except Exception as exc:
        error = exc
    agree(world, error, "checking the checkpoint's files")
    if reader is None:  # agree() raised on every rank if opening failed on any
        raise CheckpointError("internal: the checkpoint was not opened")
    return reader


def load_checkpoint(
    state: TrainState,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> tuple[str, Any, LoadReport]:
    """Load a checkpoint into ``state`` (collective over every rank of the job).

    Returns:
        The checkpoint's path, the saved ``client_state`` and what matched.

    Raises:
        CheckpointNotFoundError: no such checkpoint, or an interrupted save.
        CorruptCheckpointError: a file (shard, manifest, client state, ``latest``) fails its
            check; the message names it.
        IncompatibleCheckpointError: a different model or optimizer.
    """
    state.check_can_load()
    reader = _open_verified(state, load_dir, tag, load_optimizer_states and not load_module_only)
    manifest = reader.manifest
    report = _match_model(state, manifest, reader.path, strict)
    try:
        state.sharded.zero_grads()
        # Swapped-out states (NVMe offload) are filled in memory and written to their files.
        with state.sharded.resident(write_back=True):
            _load_params(state, reader)
            if not load_module_only and load_optimizer_states:
                _load_optimizer(state, reader)
                _load_rank_local(state, reader)
        if not load_module_only:
            _load_progress(state, reader, load_lr_scheduler_states)
        if isinstance(reader, ImportedReader):
            client_state = reader.imported.client_state(
                optimizer=load_optimizer_states and not load_module_only,
                scheduler=load_lr_scheduler_states and not load_module_only,
            )
        else:
            client_state = _load_client_state(reader.path, manifest)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"loading {reader.path} failed: {exc}") from exc
    if state.placement.global_rank == 0:
        log.info(
            "loaded checkpoint %s (saved by %d rank(s) at ZeRO stage %d, step %d)",
            reader.path,
            manifest.world_size,
            manifest.stage,
            manifest.global_steps,
        )
    return str(reader.path), client_state, report


def _load_progress(state: TrainState, reader: CheckpointReader, scheduler: bool) -> None:
    """Schedule, loss scale, counters, random states and data position."""
    manifest = reader.manifest
    if scheduler and state.lr_scheduler is not None:
        if manifest.scheduler is None:
            log.warning("%s has no lr scheduler state; the schedule starts over", reader.path)
        else:
            state.lr_scheduler.load_state_dict(manifest.scheduler)
    if state.loss_scaler is not None and manifest.loss_scaler is not None:
        state.loss_scaler.load_state_dict(manifest.loss_scaler)
    state.restore_counters(
        Counters(
            manifest.global_steps,
            manifest.global_samples,
            manifest.micro_steps,
            manifest.skipped_steps,
        )
    )
    _load_rng(state, reader)
    if state.data_loader is not None and manifest.data is not None:
        state.data_loader.load_state_dict(manifest.data)
