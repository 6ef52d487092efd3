"""``Engine.save_checkpoint``: every rank writes its share into a temporary directory, which
becomes the checkpoint only after all of them succeeded and the manifest is written.

Sequence (each arrow is an agreement: all ranks learn whether any rank failed, and all raise
together if one did, so no rank is left waiting):

1. rank 0 creates ``SAVE_DIR/.TAG.partial`` (and writes ``client_state.pt``) ->
2. each rank writes ``rankNNNNN.safetensors`` (its shards of parameters, fp32 master weights
   and optimizer states, plus its RNG states) and a small index of what is where ->
3. rank 0 merges the indexes into ``manifest.json``, renames the directory to ``SAVE_DIR/TAG``,
   then rewrites ``latest`` and prunes old checkpoints (``keep_last``).

A crash at any point before the rename leaves only the ``.partial`` directory (removed by the
next save); the previous checkpoint and ``latest`` are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerotrain.checkpoint import regions, rng
from zerotrain.checkpoint.directory import (
    check_tag,
    old_dir,
    partial_dir,
    recover,
    shard_file,
    write_latest,
)
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.manifest import (
    CLIENT_STATE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    FileInfo,
    fsync_dir,
    read_manifest,
    write_json_atomically,
    write_manifest,
)
from zerotrain.checkpoint.safetensors_io import StreamingWriter, TensorSpec, file_crc32
from zerotrain.comm.agreement import disagreements
from zerotrain.config.policies import short_dtype_name
from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.comm.collectives import Communicator
    from zerotrain.engine.engine import Engine

log = get_logger(__name__)


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` is set on any: the failing rank re-raises its own,
    the others name the ranks that failed."""
    flags = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    flags[comm.rank] = 1.0 if error is not None else 0.0
    if comm.world_size > 1:
        comm.all_reduce(flags, purpose="control")
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"rank {comm.rank}: rank(s) {failed} failed while {what} (their own error says "
            "why); nothing was renamed into place"
        )


def check_same_directory(comm: Communicator, what: str, path: Path) -> None:
    """Raise on every rank, naming each rank's value, unless all ranks passed the same
    directory (as an absolute path): each rank would otherwise write or read a different
    checkpoint, and the manifest would name files that are not beside it."""
    differing = disagreements(comm, [(what, os.path.abspath(path))])
    if differing:
        raise ValueError(
            f"rank {comm.rank}: every rank must pass the same {what}; they differ: "
            + "; ".join(differing)
        )


def _to_json(value: Any, where: str) -> Any:
    """``value`` as plain JSON (tuples become lists, 0-d tensors numbers), else an error
    naming where the unsupported value is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
        return {str(k): _to_json(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(
        f"cannot store {where} ({type(value).__name__}) in the checkpoint manifest: only "
        "numbers, strings, lists and dicts of them are supported"
    )


class _ShardPlan:
    """The tensors one rank writes, and where each element of them belongs."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.tensors: dict[str, torch.Tensor] = {}
        self.fragments: list[dict[str, Any]] = []
        self.scalars: list[dict[str, Any]] = []

    def add(self, key: str, tensor: torch.Tensor, kind: str, spans: list[regions.Span]) -> None:
        self.tensors[key] = tensor
        self.fragments += [
            {
                "kind": kind,
                "name": s.name,
                "lo": s.lo,
                "hi": s.hi,
                "file": self.file,
                "key": key,
                "offset": s.at,
            }
            for s in spans
        ]

    def add_whole(self, key: str, tensor: torch.Tensor, kind: str, name: str) -> None:
        self.add(key, tensor.reshape(-1), kind, [regions.Span(name, 0, tensor.numel(), 0)])


def _plan_units(engine: Engine, plan: _ShardPlan, names: dict[int, str]) -> None:
    comm = engine.comm
    slots_by_unit: dict[int, list[regions.Slot]] = {}
    for slot in regions.optimizer_slots(engine):
        slots_by_unit.setdefault(slot.unit.index, []).append(slot)
    state = engine.optimizer.state if engine.optimizer is not None else {}
    for unit in engine.strategy.units:
        unit_names = regions.unit_names(unit, names)
        a, b = regions.write_range(unit, comm.rank, comm.world_size)
        if a >= b:
            continue
        u = unit.index
        plan.add(
            f"u{u}.param",
            regions.param_values(unit, a, b),
            "param",
            regions.spans(unit, unit_names, a, b),
        )
        if unit.master is not None:
            mlo, mhi = unit.master_range
            lo, hi = max(a, mlo), min(b, mhi)
            if lo < hi:
                plan.add(
                    f"u{u}.master",
                    unit.master[lo - mlo : hi - mlo],
                    "master",
                    regions.spans(unit, unit_names, lo, hi),
                )
        for j, slot in enumerate(slots_by_unit.get(u, [])):
            lo, hi = max(a, slot.start), min(b, slot.end)
            if lo >= hi:
                continue
            slot_spans = regions.spans(unit, unit_names, lo, hi)
            scalars: dict[str, Any] = {}
            for name, value in state.get(slot.tensor, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == slot.tensor.shape:
                    flat = value.reshape(-1)[lo - slot.start : hi - slot.start]
                    plan.add(f"u{u}.s{j}.{name}", flat, f"optim.{name}", slot_spans)
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    scalars[name] = {"value": value.item(), "dtype": short_dtype_name(value.dtype)}
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    scalars[name] = {"value": float(value), "dtype": None}
                else:
                    raise CheckpointError(
                        f"optimizer state '{name}' of {type(engine.optimizer).__name__} is a "
                        f"{type(value).__name__} of shape {getattr(value, 'shape', '?')}; "
                        "checkpoints store element-wise tensors and scalars only"
                    )
            if scalars:
                plan.scalars.append(
                    {"spans": [[s.name, s.lo, s.hi] for s in slot_spans], "values": scalars}
                )


def _model_tables(engine: Engine) -> tuple[dict[str, Any], dict[str, str]]:
    """The manifest's ``tensors`` (state-dict order) and ``aliases`` tables."""
    model = engine.module
    original = {id(t): dtype for t, dtype in engine._cast_back}
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for unit in engine.strategy.units:
        for param, spec, dtype in zip(
            unit.buffer.params, unit.buffer.layout.params, unit.model_dtypes, strict=True
        ):
            shapes[id(param)] = (spec.shape, dtype)
    params = {id(p): (name, p) for name, p in model.named_parameters()}
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
        shape, own = shapes.get(id(value), (tuple(value.shape), original.get(id(value))))
        tensors[key] = {
            "kind": "param" if id(value) in params else "buffer",
            "shape": list(shape),
            "dtype": short_dtype_name(own or value.dtype),
            "trainable": bool(value.requires_grad) if id(value) in params else False,
        }
    return tensors, aliases


def _write_shard(path: Path, plan: _ShardPlan) -> tuple[int, int]:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in plan.tensors.items()]
    writer = StreamingWriter(path, specs, {"format": FORMAT})
    try:
        for key, tensor in plan.tensors.items():
            writer.write(key, tensor)
    finally:
        size_crc = writer.close()
    return size_crc


def _check_same_tag(engine: Engine, tag: str) -> None:
    comm = engine.comm
    if comm.world_size == 1 or engine.policy.tag_validation == "ignore":
        return
    code = float(zlib.crc32(tag.encode()))
    high, negated_low = comm.all_reduce_floats([code, -code], op="max")
    if high == -negated_low:
        return
    message = f"rank {comm.rank} saves checkpoint tag {tag!r}, but the ranks passed different tags"
    if engine.policy.tag_validation == "fail":
        raise ValueError(message + " (checkpoint.tag_validation is 'Fail')")
    log.warning("%s; each rank writes into its own tag's directory", message)


def _save_client_state(path: Path, client_state: Any) -> None:
    torch.save(client_state, path)
    try:
        torch.load(path, weights_only=True)
    except Exception as exc:
        path.unlink()
        raise ValueError(
            "client_state must be loadable without unpickling arbitrary code (tensors, "
            "numbers, strings, and lists, tuples and dicts of them); torch.load("
            f"weights_only=True) refuses it: {exc}"
        ) from exc


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Remove the oldest complete checkpoints beyond ``keep_last`` (never ``current``)."""
    found = []
    for manifest in root.glob(f"[!.]*/{MANIFEST}"):
        try:
            found.append((read_manifest(manifest.parent).created, manifest.parent))
        except CheckpointError:
            continue  # not ours, or damaged: left for a person to look at
    found.sort()
    for _, path in found[: max(0, len(found) - keep_last)]:
        if path.name != current:
            shutil.rmtree(path)
            log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)


def save_checkpoint(
    engine: Engine,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Any = None,
    keep_last: int | None = None,
) -> str:
    """Write a checkpoint of ``engine`` to ``save_dir/tag`` (collective); returns its path."""
    comm = engine.comm
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    _check_same_tag(engine, tag)
    keep_last = keep_last if keep_last is not None else engine.policy.keep_last
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(save_dir)
    check_same_directory(comm, "save_dir", root)
    final, partial = root / tag, partial_dir(root, tag)
    started = time.perf_counter()

    error: BaseException | None = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            recover(root)  # a save that died replacing a tag: finish or undo it first
            partial.mkdir()
            if client_state is not None:
                _save_client_state(partial / CLIENT_STATE, client_state)
        except Exception as exc:
            error = exc
    agree(comm, error, f"creating {partial}")

    try:
        # Swapped-out states (NVMe offload) are read back for as long as they are written.
        with engine.strategy.resident(write_back=False):
            engine.strategy.adopt_outside_changes()  # what the user wrote since the last step
            names = regions.canonical_names(engine.module)
            plan = _ShardPlan(shard_file(comm.rank))
            _plan_units(engine, plan, names)
            state, rng_tensors = rng.capture(engine.device)
            plan.tensors.update(rng_tensors)
            if comm.rank == 0:
                for name, param in regions.loose_parameters(engine):
                    plan.add_whole(f"loose.{name}", param.detach(), "param", name)
                tables = _model_tables(engine)
                for name, buffer in regions.persistent_buffers(engine.module):
                    if name in tables[0]:
                        plan.add_whole(f"buffer.{name}", buffer.detach(), "buffer", name)
            size, crc = _write_shard(partial / plan.file, plan)
            index = {
                "file": plan.file,
                "bytes": size,
                "crc32": crc,
                "fragments": plan.fragments,
                "scalars": plan.scalars,
                "rng": state,
            }
            write_json_atomically(partial / f"{plan.file}.index.json", index)
    except Exception as exc:
        error = exc
    agree(comm, error, f"writing their shards into {partial}")

    if comm.rank == 0:
        try:
            _finish(engine, root, partial, final, tag, tables, client_state is not None)
            if keep_last is not None:
                _prune(root, keep_last, tag)
        except Exception as exc:
            error = exc
    agree(comm, error, f"writing the manifest of {final}")
    if comm.rank == 0:
        total = sum(p.stat().st_size for p in final.iterdir())
        log.info(
            "saved checkpoint %s (%s in %.2f s)",
            final,
            f"{total / 2**20:.1f} MiB",
            time.perf_counter() - started,
        )
    return str(final)


def _finish(
    engine: Engine,
    root: Path,
    partial: Path,
    final: Path,
    tag: str,
    tables: tuple[dict[str, Any], dict[str, str]],
    has_client_state: bool,
) -> None:
    """Rank 0: merge the rank indexes into the manifest, rename into place, point ``latest``."""
    files, fragments, scalars, rng_states = {}, [], [], []
    for rank in range(engine.comm.world_size):
        index_path = partial / f"{shard_file(rank)}.index.json"
        index = json.loads(index_path.read_text())
        files[index["file"]] = {"bytes": index["bytes"], "crc32": index["crc32"]}
        fragments += index["fragments"]
        scalars += index["scalars"]
        rng_states.append(index["rng"])
        index_path.unlink()
    tensors, aliases = tables
    optimizer = engine.optimizer
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tag": tag,
        "created": time.time(),
        "world_size": engine.comm.world_size,
        "stage": engine.policy.stage,
        "compute_dtype": short_dtype_name(engine.precision.compute)
        if engine.precision.compute is not None
        else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "tensors": tensors,
        "aliases": aliases,
        "files": files,
        "fragments": fragments,
        "optimizer": None
        if optimizer is None
        else {
            "type": type(optimizer).__name__,
            "groups": [
                _to_json({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
                for i, g in enumerate(optimizer.param_groups)
            ],
            "scalars": scalars,
        },
        "scheduler": _to_json(engine.lr_scheduler.state_dict(), "the lr scheduler's state")
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict")
        else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
        "data": _to_json(engine.training_dataloader.state_dict(), "the data loader's state")
        if engine.training_dataloader is not None
        else None,
        "rng": rng_states,
        "client_state": CLIENT_STATE if has_client_state else None,
    }
    if has_client_state:
        client = partial / CLIENT_STATE
        files[CLIENT_STATE] = FileInfo(
            bytes=client.stat().st_size, crc32=file_crc32(client)
        ).model_dump()
    checksum = write_manifest(partial, manifest)
    fsync_dir(partial)
    # Commit: after each step one complete copy of the tag exists where locate() looks for it
    # (TAG, or .TAG.old while latest still names the old manifest), and recover() finishes
    # or undoes whatever a crash interrupted.
    if final.exists():  # the same tag saved again
        old = old_dir(root, tag)
        os.replace(final, old)
        os.replace(partial, final)
        write_latest(root, tag, checksum)
        fsync_dir(root)
        shutil.rmtree(old)
    else:
        os.replace(partial, final)
        write_latest(root, tag, checksum)
    fsync_dir(root)
