"""``Engine.load_checkpoint``: fill this engine's units, optimizer and counters from a
checkpoint written by any number of ranks at any ZeRO stage and precision.

Each rank reads only what it keeps authoritatively (its shard of each unit; everything at
stage 0), by parameter name and element range; stages 1-2 then all-gather parameters as after
an optimizer step. Files are checked (size, CRC-32) before anything is read, each rank taking
a share of them, and every rank raises if any file is bad.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.checkpoint import regions, rng
from zerotrain.checkpoint.directory import locate
from zerotrain.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from zerotrain.checkpoint.manifest import Manifest
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.checkpoint.save import agree, check_same_directory
from zerotrain.config.policies import DTYPE_BY_NAME
from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)


@dataclass
class LoadReport:
    """What ``load_checkpoint`` matched: model entries absent from the checkpoint
    (``missing``, kept as they were) and checkpoint entries the model lacks (``unexpected``)."""

    path: str = ""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _model_shapes(engine: Engine) -> dict[str, tuple[int, ...]]:
    shapes = {}
    names_by_id = regions.canonical_names(engine.module)
    for unit in engine.strategy.units:
        names = regions.unit_names(unit, names_by_id)
        for name, spec in zip(names, unit.buffer.layout.params, strict=True):
            shapes[name] = spec.shape
    for name, param in regions.loose_parameters(engine):
        shapes[name] = tuple(param.shape)
    for name, buffer in regions.persistent_buffers(engine.module):
        shapes.setdefault(name, tuple(buffer.shape))
    return shapes


def _match_model(engine: Engine, manifest: Manifest, path: Path, strict: bool) -> LoadReport:
    ours = _model_shapes(engine)
    aliases = set(manifest.aliases)
    theirs = {n: tuple(t.shape) for n, t in manifest.tensors.items()}
    wrong = [
        f"{n}: checkpoint {list(theirs[n])}, model {list(ours[n])}"
        for n in theirs  # in state-dict order
        if n in ours and theirs[n] != ours[n]
    ]
    if wrong:
        raise IncompatibleCheckpointError(
            f"{path} holds a different model: shapes differ for {len(wrong)} tensor(s): "
            + "; ".join(wrong[:5])
            + (" ..." if len(wrong) > 5 else "")
        )
    report = LoadReport(
        str(path),
        missing=[n for n in ours if n not in theirs and n not in aliases],
        unexpected=[n for n in theirs if n not in ours],
    )
    if strict and (report.missing or report.unexpected):
        raise IncompatibleCheckpointError(
            f"{path} does not match the model (pass strict=False to load what matches): "
            f"missing from the checkpoint {report.missing[:10]}, not in the model "
            f"{report.unexpected[:10]}"
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


def _load_params(engine: Engine, reader: CheckpointReader) -> None:
    names_by_id = regions.canonical_names(engine.module)
    for unit in engine.strategy.units:
        names = regions.unit_names(unit, names_by_id)
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
                # fp32 values come from the master copy where one was saved.
                use_master = out.dtype == torch.float32 and reader.covers(
                    "master", source, span.lo, span.hi
                )
                reader.read_into("master" if use_master else "param", source, span.lo, out)
            if unit.master is not None:
                mlo, mhi = unit.master_range
                for span in regions.spans(unit, names, mlo, mhi):
                    source = reader.stored_name(span.name)
                    if source is None:
                        continue
                    out = unit.master[span.at : span.at + span.hi - span.lo]
                    saved = reader.covers("master", source, span.lo, span.hi)
                    reader.read_into("master" if saved else "param", source, span.lo, out)
                unit.publish()
    handles = [h for h in (unit.gather() for unit in engine.strategy.units) if h is not None]
    for handle in handles:
        handle.wait()
    with torch.no_grad():
        for name, param in regions.loose_parameters(engine):
            if (source := reader.stored_name(name)) is not None:
                param.data.copy_(reader.tensor(source, param.dtype))
        for name, buffer in regions.persistent_buffers(engine.module):
            if (source := reader.stored_name(name)) is not None:
                buffer.data.copy_(reader.tensor(source, buffer.dtype))


def _slot_scalars(
    manifest: Manifest, spans: list[regions.Span], where: str
) -> dict[str, tuple[float, str | None]]:
    """The scalar states (Adam's step) of a new optimizer tensor covering ``spans``: the
    values saved for the tensors that covered the same elements (when they disagree, which
    happens only when some parameters skipped steps unused, the one covering most wins)."""
    assert manifest.optimizer is not None
    votes: dict[str, Counter[tuple[float, str | None]]] = {}
    wanted = {(s.name): (s.lo, s.hi) for s in spans}
    for saved in manifest.optimizer.scalars:
        overlap = 0
        for name, lo, hi in saved.spans:
            if name in wanted:
                a, b = wanted[name]
                overlap += max(0, min(b, hi) - max(a, lo))
        if overlap:
            for key, scalar in saved.values.items():
                votes.setdefault(key, Counter())[scalar.value, scalar.dtype] += overlap
    chosen = {}
    for key, counter in votes.items():
        if len(counter) > 1:
            log.debug("%s: saved '%s' values differ %s; using the most common", where, key, counter)
        chosen[key] = counter.most_common(1)[0][0]
    return chosen


def _load_optimizer(engine: Engine, reader: CheckpointReader) -> None:
    optimizer = engine.optimizer
    info = reader.manifest.optimizer
    path = reader.path
    if optimizer is None:
        log.info("%s: this engine has no optimizer; optimizer states not loaded", path)
        return
    if info is None:
        raise IncompatibleCheckpointError(
            f"{path} was saved without an optimizer; load it with load_optimizer_states=False"
        )
    if info.type != type(optimizer).__name__ or len(info.groups) != len(optimizer.param_groups):
        raise IncompatibleCheckpointError(
            f"{path} holds the states of {info.type} with {len(info.groups)} param group(s); "
            f"this engine steps {type(optimizer).__name__} with {len(optimizer.param_groups)}: "
            "load with load_optimizer_states=False to take only the weights"
        )
    names_by_id = regions.canonical_names(engine.module)
    states = sorted(k.removeprefix("optim.") for k in reader.kinds() if k.startswith("optim."))
    for slot in regions.optimizer_slots(engine):
        names = regions.unit_names(slot.unit, names_by_id)
        spans = [
            dataclasses.replace(s, name=source)
            for s in regions.spans(slot.unit, names, slot.start, slot.end)
            if (source := reader.stored_name(s.name)) is not None
        ]
        state: dict[str, Any] = {}
        for key in states:
            kind = f"optim.{key}"
            dtypes = [reader.dtype(kind, s.name) for s in spans]
            dtype = next((d for d in dtypes if d is not None), None)
            if dtype is None:
                continue
            value = torch.zeros(slot.tensor.numel(), dtype=dtype, device=slot.tensor.device)
            for s in spans:
                reader.read_into(kind, s.name, s.lo, value[s.at : s.at + s.hi - s.lo], partial=True)
            state[key] = value.view(slot.tensor.shape)
        if state:
            for key, (number, dtype_name) in _slot_scalars(
                reader.manifest, spans, str(path)
            ).items():
                state[key] = (
                    torch.tensor(number, dtype=DTYPE_BY_NAME[dtype_name], device=slot.tensor.device)
                    if dtype_name is not None
                    else number
                )
            optimizer.state[slot.tensor] = state
        else:
            optimizer.state.pop(slot.tensor, None)
    for group, saved in zip(optimizer.param_groups, info.groups, strict=True):
        for key, value in saved.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value


def _load_rng(engine: Engine, reader: CheckpointReader) -> None:
    manifest = reader.manifest
    rank, world = engine.comm.rank, engine.comm.world_size
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
    tensors = {}
    for key in (rng.TORCH_KEY, rng.CUDA_KEY):
        value = reader.rank_tensor(rank, key)
        if value is not None:
            tensors[key] = value
    rng.restore(manifest.rng[rank], tensors, engine.device)


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


def load_checkpoint(
    engine: Engine,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    strict: bool = True,
) -> tuple[str, Any, LoadReport]:
    """Load a checkpoint into ``engine`` (collective); returns its path, the saved
    ``client_state`` and what matched."""
    if engine._backward_pending_step:
        raise RuntimeError("load_checkpoint() between backward() and step(): call step() first")
    comm = engine.comm
    error: BaseException | None = None
    reader: CheckpointReader | None = None
    check_same_directory(comm, "load_dir", Path(load_dir))
    try:
        reader = CheckpointReader(*locate(load_dir, tag))
        files = sorted(reader.manifest.files)
        reader.verify(files[comm.rank :: comm.world_size])
    except Exception as exc:
        error = exc
    agree(comm, error, "checking the checkpoint's files")
    assert reader is not None
    manifest = reader.manifest
    report = _match_model(engine, manifest, reader.path, strict)
    try:
        engine.strategy.zero_grads()
        # Swapped-out states (NVMe offload) are filled in memory and written to their files.
        with engine.strategy.resident(write_back=True):
            _load_params(engine, reader)
            if not load_module_only and load_optimizer_states:
                _load_optimizer(engine, reader)
        if not load_module_only:
            if load_lr_scheduler_states and engine.lr_scheduler is not None:
                if manifest.scheduler is None:
                    log.warning(
                        "%s has no lr scheduler state; the schedule starts over", reader.path
                    )
                else:
                    engine.lr_scheduler.load_state_dict(manifest.scheduler)
            if engine.loss_scaler is not None and manifest.loss_scaler is not None:
                engine.loss_scaler.load_state_dict(manifest.loss_scaler)
            engine.global_steps = manifest.global_steps
            engine.global_samples = manifest.global_samples
            # The next micro-step starts a window (a partial window's gradients are not
            # saved), also when the accumulation steps differ from the saving run's.
            engine.micro_steps = manifest.global_steps * engine.gradient_accumulation_steps()
            engine.skipped_steps = manifest.skipped_steps
            _load_rng(engine, reader)
            if engine.training_dataloader is not None and manifest.data is not None:
                engine.training_dataloader.load_state_dict(manifest.data)
        client_state = _load_client_state(reader.path, manifest)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"loading {reader.path} failed: {exc}") from exc
    engine.window_losses.clear()
    if comm.rank == 0:
        log.info(
            "loaded checkpoint %s (saved by %d rank(s) at ZeRO stage %d, step %d)",
            reader.path,
            manifest.world_size,
            manifest.stage,
            manifest.global_steps,
        )
    return str(reader.path), client_state, report
