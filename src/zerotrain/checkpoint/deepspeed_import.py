"""DeepSpeed checkpoints described as pieces of whole tensors, by parameter name.

A DeepSpeed ZeRO checkpoint (``SAVE_DIR/TAG/``) holds one model-states file
(``mp_rank_00_model_states.pt``; at stage 3 one per rank, ``zero_pp_rank_R_mp_rank_00_...``)
with the module, the counters, the schedule and the client state, and one optimizer file per
data-parallel rank (``[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``) with that
rank's partition of the fp32 master weights and of the optimizer states. The layouts, as
DeepSpeed's own ``zero_to_fp32.py`` reads them:

- stages 1-2: per param group, the ranks' partitions concatenated are the group's parameters
  flattened in ``param_shapes`` order, each followed by its ``param_alignment_paddings``
  entry, with the group's padding at the end (held by the last ranks);
- stage 3: per rank, the partitions of every parameter in ``param_shapes`` order, each
  ``ceil(numel / world)`` elements (the last rank's zero-padded), across the sub-groups;
- stage 0: the module holds the weights and ``optimizer`` torch's state dict, whose states
  are keyed by position in the param groups (no names: matched here by the order of the
  job's own groups, shapes checked).

A universal checkpoint (``ds_to_universal`` output, found through ``latest_universal``)
holds each parameter whole: ``zero/NAME/fp32.pt``, one file per optimizer state and
``step.pt``, beside a model-states file.

Nothing is copied here: each piece points into a partition as DeepSpeed saved it (the
files memory-mapped), and a loading rank copies only the elements it keeps.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.deepspeed_pickle import SavedLossScaler, load_deepspeed_file
from zerotrain.checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
_OPTIM = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_OTHER_LAYOUTS = ("mp_rank_01_model_states.pt", "layer_*-model_states.pt")
# What DeepSpeed's load_checkpoint keeps from the model-states file; the rest is returned to
# the caller as the client state (it also drops lr_scheduler and optimizer when it loads them).
_ENGINE_KEYS = (
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
)
# DeepSpeed optimizer names (its config's ``type``, or the class it saved) -> zerotrain's.
_OPTIMIZERS = {
    "adam": "Adam",
    "adamw": "Adam",
    "fusedadam": "Adam",
    "deepspeedcpuadam": "Adam",
    "lamb": "Lamb",
    "fusedlamb": "Lamb",
    "sgd": "SGD",
}
# Param-group settings carried over (the rest of a torch group, such as ``foreach``, is the
# kernel's choice, not the run's).
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


def is_deepspeed_checkpoint(load_dir: Path, tag: str | None) -> bool:
    """Whether ``load_dir`` (with ``tag``, or the one its ``latest`` names) is a DeepSpeed
    checkpoint rather than a zerotrain one."""
    try:
        return _tag_dir(load_dir, tag, quiet=True) is not None
    except CheckpointNotFoundError:
        return False


def _is_ds_dir(path: Path) -> bool:
    return path.is_dir() and (
        (path / MODEL_STATES).is_file()
        or any(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
        or ((path / "zero").is_dir() and not (path / "manifest.json").is_file())
    )


def _tag_dir(load_dir: Path, tag: str | None, *, quiet: bool = False) -> Path | None:
    if _is_ds_dir(load_dir) and tag is None:
        return load_dir
    if tag is None:
        for pointer in (LATEST, LATEST_UNIVERSAL):  # DeepSpeed's engine reads `latest` too
            file = load_dir / pointer
            if file.is_file():
                tag = file.read_text().strip()
                if "\n" in tag:  # a zerotrain pointer of format 2
                    return None
                break
        else:
            return None
    path = load_dir / tag
    if _is_ds_dir(path):
        return path
    if not quiet and not path.is_dir():
        raise CheckpointNotFoundError(f"{path} does not exist")
    return None


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of flattened tensor ``name`` stored as ``kind`` (``param``,
    ``master``, ``buffer`` or ``optim.<state>``) are elements ``offset...`` of
    ``sources[source]``."""

    kind: str
    name: str
    lo: int
    hi: int
    source: str
    offset: int


@dataclass(frozen=True)
class TensorEntry:
    """One entry of the saved model: its shape, its dtype in the model, and whether the
    optimizer stepped it."""

    kind: str  # "param" or "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool


@dataclass
class ImportedCheckpoint:
    """A DeepSpeed checkpoint as pieces of whole tensors, by name."""

    path: Path
    stage: int
    world_size: int
    compute_dtype: torch.dtype | None
    tensors: dict[str, TensorEntry]  # in the saved module's order
    sources: dict[str, torch.Tensor]  # 1-D, memory-mapped from the files where possible
    pieces: list[Piece]
    aliases: dict[str, str]  # tied parameter -> the one saved
    optimizer_type: str | None  # zerotrain's name for it; None: no optimizer states
    optimizer_scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]]  # by name
    groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any] | None
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    model_states: dict[str, Any] = field(repr=False, default_factory=dict)

    def client_state(self, *, optimizer: bool, scheduler: bool) -> dict[str, Any]:
        """What DeepSpeed's ``load_checkpoint`` returns as the client state."""
        dropped = set(_ENGINE_KEYS) | ({"optimizer"} if optimizer else set())
        dropped |= {"lr_scheduler"} if scheduler else set()
        return {k: v for k, v in self.model_states.items() if k not in dropped}

    def whole(self, kind: str, name: str) -> torch.Tensor:
        """Tensor ``name`` stored as ``kind``, assembled (for tools and tests; the loader
        reads only the elements it needs)."""
        entry = self.tensors[name]
        pieces = [p for p in self.pieces if p.kind == kind and p.name == name]
        if not pieces:
            raise KeyError(f"no {kind} stored for {name}")
        out = torch.empty(math.prod(entry.shape), dtype=self.sources[pieces[0].source].dtype)
        for p in pieces:
            out[p.lo : p.hi] = self.sources[p.source][p.offset : p.offset + p.hi - p.lo]
        return out.view(entry.shape)


class _Builder:
    """Collects the sources and pieces of one checkpoint."""

    def __init__(self) -> None:
        self.sources: dict[str, torch.Tensor] = {}
        self.pieces: list[Piece] = []

    def source(self, key: str, tensor: torch.Tensor) -> str:
        self.sources[key] = tensor.reshape(-1)  # a view: memory-mapped storage stays mapped
        return key

    def whole(self, kind: str, name: str, tensor: torch.Tensor, key: str) -> None:
        self.source(key, tensor)
        self.pieces.append(Piece(kind, name, 0, tensor.numel(), key, 0))

    def span(self, kind: str, name: str, lo: int, hi: int, key: str, offset: int) -> None:
        if lo < hi:
            self.pieces.append(Piece(kind, name, lo, hi, key, offset))


GroupNames = Callable[[], list[list[str]]]


def read_deepspeed_checkpoint(
    load_dir: Path, tag: str | None, group_names: GroupNames | None = None
) -> ImportedCheckpoint:
    """Read DeepSpeed checkpoint ``tag`` under ``load_dir`` (or the one ``latest`` /
    ``latest_universal`` names; ``load_dir`` may be the tag directory itself).
    ``group_names`` gives the parameter names of each of the loading job's param groups, in
    order: stage-0 checkpoints need it to name their optimizer states (without it, their
    weights are read and their optimizer states left out)."""
    path = _tag_dir(load_dir, tag)
    if path is None:
        raise CheckpointNotFoundError(f"{load_dir} holds no DeepSpeed checkpoint")
    for pattern in _OTHER_LAYOUTS:
        if found := sorted(path.glob(pattern)):
            raise IncompatibleCheckpointError(
                f"{found[0]}: a tensor- or pipeline-parallel DeepSpeed checkpoint; zerotrain "
                "reads data-parallel ZeRO checkpoints and universal checkpoints. Convert it "
                "with DeepSpeed's ds_to_universal and load the result"
            )
    if (path / "zero").is_dir():
        return _read_universal(path)
    model_files = sorted(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
    model_file = model_files[0] if model_files else path / MODEL_STATES
    model_states = _as_dict(load_deepspeed_file(model_file))
    optim_files = _optimizer_files(path)
    if not optim_files:
        return _read_stage0(path, model_states, group_names)
    optims = [_as_dict(load_deepspeed_file(f))["optimizer_state_dict"] for f in optim_files]
    stage = int(optims[0]["zero_stage"])
    world = _world_size(optims[0], optim_files)
    shapes = _param_shapes(model_states, path)
    built = _Builder()
    if stage == 3:
        _stage3(built, shapes, optims, world, path)
        parts = [
            _as_dict(load_deepspeed_file(f)).get("frozen_param_fragments") for f in model_files
        ]
        _stage3_frozen(built, model_states, parts, path)
    else:
        _stage12(built, shapes, optims, path)
        for name, value in (model_states.get("frozen_param_fragments") or {}).items():
            built.whole("param", name, value, f"frozen/{name}")
    scalars = _scalars_by_name(shapes, _base(optims[0]), stage)
    return _assemble(
        path,
        stage,
        world,
        model_states,
        built,
        scalars,
        _base(optims[0]).get("param_groups", []),
        optims[0].get("loss_scaler"),
    )


def _as_dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise CorruptCheckpointError(f"a DeepSpeed checkpoint file holds {type(value).__name__}")
    return dict(value)


def _optimizer_files(path: Path) -> list[Path]:
    found = {}
    for file in path.iterdir():
        if match := _OPTIM.fullmatch(file.name):
            found[int(match.group(1))] = file
    return [found[r] for r in sorted(found)]


def _world_size(first: dict[str, Any], files: list[Path]) -> int:
    count = first["partition_count"]
    world = max(count) if isinstance(count, list) else int(count)
    ranks = [int(_OPTIM.fullmatch(f.name).group(1)) for f in files]  # type: ignore[union-attr]
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise CheckpointNotFoundError(
            f"{files[0].parent} was saved by {world} data-parallel ranks, but the optimizer "
            f"files of rank(s) {missing or ranks[world:]} are "
            + ("missing" if missing else "extra (a save of a different world size over it?)")
        )
    return world


def _param_shapes(model_states: dict[str, Any], path: Path) -> list[dict[str, tuple[int, ...]]]:
    shapes = model_states.get("param_shapes")
    if not shapes:
        raise CorruptCheckpointError(f"{path}: the model states lack param_shapes")
    return [{name: tuple(shape) for name, shape in group.items()} for group in shapes]


def _base(optim: dict[str, Any]) -> dict[str, Any]:
    """The wrapped torch optimizer's state dict (its key differs by stage)."""
    return optim.get("base_optimizer_state") or optim.get("optimizer_state_dict") or {}


def _element_keys(optim: dict[str, Any], index: int, numel: int) -> list[str]:
    """The optimizer's element-wise states of (sub-)group ``index``: tensors of at least the
    partition's length (0-d ones such as ``step`` are scalars)."""
    state = _base(optim).get("state", {}).get(index, {})
    return [
        key
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() >= numel
    ]


def _stage12(
    built: _Builder,
    shapes: list[dict[str, tuple[int, ...]]],
    optims: list[dict[str, Any]],
    path: Path,
) -> None:
    """Stages 1-2: per group, the ranks' partitions in turn hold the group's flat buffer."""
    paddings = optims[0].get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        # The fp32 partitions are saved without their padding, so their lengths say where
        # each rank's part starts; the optimizer states keep the padding at their ends.
        parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
        starts = [sum(p.numel() for p in parts[:r]) for r in range(len(parts))]
        keys = _element_keys(optims[0], g, parts[0].numel())
        for r, (optim, part) in enumerate(zip(optims, parts, strict=True)):
            built.source(f"fp32/{r}/{g}", part)
            for key in keys:
                built.source(f"{key}/{r}/{g}", _base(optim)["state"][g][key])
        total = starts[-1] + parts[-1].numel()
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > total:
                raise CorruptCheckpointError(
                    f"{path}: param group {g} holds {total} elements, fewer than its "
                    f"parameters need (at {name})"
                )
            for r, (start, part) in enumerate(zip(starts, parts, strict=True)):
                a, b = max(offset, start), min(offset + numel, start + part.numel())
                built.span("master", name, a - offset, b - offset, f"fp32/{r}/{g}", a - start)
                for key in keys:
                    built.span(
                        f"optim.{key}", name, a - offset, b - offset, f"{key}/{r}/{g}", a - start
                    )
            offset += numel + (paddings[g][i] if paddings else 0)


def _stage3(
    built: _Builder,
    shapes: list[dict[str, tuple[int, ...]]],
    optims: list[dict[str, Any]],
    world: int,
    path: Path,
) -> None:
    """Stage 3: each rank's sub-groups in turn hold every parameter's partition in turn."""
    flat_groups = [o["fp32_flat_groups"] for o in optims]
    sizes = [t.numel() for t in flat_groups[0]]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    keys = _element_keys(optims[0], 0, sizes[0])
    for r, optim in enumerate(optims):
        for i, tensor in enumerate(flat_groups[r]):
            built.source(f"fp32/{r}/{i}", tensor)
            for key in keys:
                built.source(f"{key}/{r}/{i}", _base(optim)["state"][i][key])
    names = {n: s for group in shapes for n, s in group.items()}
    wanted = sum(math.ceil(math.prod(s) / world) for s in names.values())
    if bounds[-1] != wanted:
        raise CorruptCheckpointError(
            f"{path}: each rank's stage-3 partition holds {bounds[-1]} elements; the "
            f"parameters in param_shapes need {wanted}"
        )
    at = 0  # where the current parameter's partition starts in each rank's flat sequence
    for name, shape in names.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        for r in range(world):
            lo, hi = min(numel, r * part), min(numel, (r + 1) * part)
            # The partition may cross sub-groups; cut it at their bounds.
            for i in range(len(sizes)):
                a, b = max(at, bounds[i]), min(at + hi - lo, bounds[i + 1])
                if a < b:
                    span_lo = lo + a - at
                    built.span(
                        "master", name, span_lo, span_lo + b - a, f"fp32/{r}/{i}", a - bounds[i]
                    )
                    for key in keys:
                        built.span(
                            f"optim.{key}",
                            name,
                            span_lo,
                            span_lo + b - a,
                            f"{key}/{r}/{i}",
                            a - bounds[i],
                        )
        at += part


def _stage3_frozen(
    built: _Builder,
    model_states: dict[str, Any],
    parts: list[dict[str, torch.Tensor] | None],
    path: Path,
) -> None:
    for name, shape in (model_states.get("frozen_param_shapes") or {}).items():
        numel = math.prod(shape)
        part = math.ceil(numel / len(parts))
        for r, fragments in enumerate(parts):
            if fragments is None or name not in fragments:
                raise CorruptCheckpointError(
                    f"{path}: the model states of rank {r} lack frozen parameter {name}"
                )
            key = built.source(f"frozen/{r}/{name}", fragments[name])
            built.span("param", name, min(numel, r * part), min(numel, (r + 1) * part), key, 0)


def _scalars_by_name(
    shapes: list[dict[str, tuple[int, ...]]], base: dict[str, Any], stage: int
) -> dict[str, dict[str, tuple[float, torch.dtype | None]]]:
    """Scalar optimizer states (``step``) of each parameter: its group's (stages 1-2: one
    state per group; stage 3: one per sub-group, taken from the first)."""
    state = base.get("state", {})
    out = {}
    for g, group in enumerate(shapes):
        source = state.get(g if stage < 3 else 0, {})
        values = {
            key: _scalar(value)
            for key, value in source.items()
            if not isinstance(value, torch.Tensor) or value.dim() == 0
        }
        for name in group:
            out[name] = values
    return out


def _scalar(value: Any) -> tuple[float, torch.dtype | None]:
    if isinstance(value, torch.Tensor):
        return float(value), value.dtype
    return float(value), None


def _read_stage0(
    path: Path, model_states: dict[str, Any], group_names: GroupNames | None
) -> ImportedCheckpoint:
    """No ZeRO: the module holds the weights, ``optimizer`` torch's state dict."""
    module = model_states["module"]
    optimizer = model_states.get("optimizer")
    built = _Builder()
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]] = {}
    groups: list[dict[str, Any]] = []
    if isinstance(optimizer, Mapping) and "param_groups" not in optimizer and group_names:
        raise IncompatibleCheckpointError(
            f"{path}: its optimizer state (keys {sorted(optimizer)[:6]}) is a DeepSpeed "
            "wrapper zerotrain does not read without ZeRO (fp16 or bf16 at stage 0); load with "
            "load_optimizer_states=False to take the weights, or convert it with DeepSpeed's "
            "ds_to_universal"
        )
    if isinstance(optimizer, Mapping) and "param_groups" in optimizer and group_names:
        groups = list(optimizer["param_groups"])
        names = group_names()
        if len(names) != len(groups):
            raise IncompatibleCheckpointError(
                f"{path}: a DeepSpeed checkpoint without ZeRO names no parameters in its "
                f"optimizer state ({len(groups)} param group(s)); zerotrain matches them by "
                f"position within the job's own param groups, and this job has "
                f"{len(names)}. Load with "
                "load_optimizer_states=False to take the weights only"
            )
        for g, (group, ours) in enumerate(zip(groups, names, strict=True)):
            if len(group["params"]) != len(ours):
                raise IncompatibleCheckpointError(
                    f"{path}: param group {g} holds {len(group['params'])} parameters in the "
                    f"checkpoint and {len(ours)} in this job; load with "
                    "load_optimizer_states=False to take the weights only"
                )
            for index, name in zip(group["params"], ours, strict=True):
                for key, value in optimizer["state"].get(index, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:
                        scalars.setdefault(name, {})[key] = _scalar(value)
                        continue
                    if name in module and value.shape != module[name].shape:
                        raise IncompatibleCheckpointError(
                            f"{path}: optimizer state {key} of parameter #{index} has shape "
                            f"{list(value.shape)}, but {name}, the parameter at its place in "
                            f"this job's group {g}, has {list(module[name].shape)}: the "
                            "groups list parameters in another order; load with "
                            "load_optimizer_states=False"
                        )
                    built.whole(f"optim.{key}", name, value, f"{key}/{name}")
    buffers = set(model_states.get("buffer_names") or [])
    for name, value in module.items():
        if name not in buffers and value.is_floating_point():
            built.whole("master", name, value.float(), f"fp32/{name}")
    return _assemble(
        path,
        0,
        int(model_states.get("dp_world_size", 1)),
        model_states,
        built,
        scalars,
        groups,
        None,
    )


def _read_universal(path: Path) -> ImportedCheckpoint:
    """``ds_to_universal`` output: every parameter whole under ``zero/NAME/``."""
    stage3_files = sorted(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
    model_file = path / MODEL_STATES if (path / MODEL_STATES).is_file() else stage3_files[0]
    model_states = _as_dict(load_deepspeed_file(model_file))
    shapes = _param_shapes(model_states, path)
    common = _as_dict(load_deepspeed_file(path / "zero" / "optimizer_state.pt"))
    built = _Builder()
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]] = {}
    for group in shapes:
        for name, shape in group.items():
            folder = path / "zero" / name
            if not (folder / "fp32.pt").is_file():
                raise CheckpointNotFoundError(f"{folder / 'fp32.pt'} is missing")
            for file in sorted(folder.glob("*.pt")):
                value = load_deepspeed_file(file)
                key = file.stem
                if isinstance(value, Mapping):
                    value = value["param"]
                if not isinstance(value, torch.Tensor):
                    raise CorruptCheckpointError(f"{file} holds no tensor")
                if value.dim() == 0:
                    scalars.setdefault(name, {})[key] = _scalar(value)
                    continue
                if value.numel() != math.prod(shape):
                    raise CorruptCheckpointError(
                        f"{file}: {list(value.shape)}, but param_shapes gives {list(shape)} "
                        "(a tensor-parallel universal checkpoint? zerotrain reads tp=1 only)"
                    )
                kind = "master" if key == "fp32" else f"optim.{key}"
                built.whole(kind, name, value, f"{key}/{name}")
            if name not in scalars and (step := _universal_step(common)) is not None:
                # Stage-3 conversions keep one step for all, in the global state.
                scalars[name] = {"step": step}
    return _assemble(
        path,
        int(common.get("zero_stage", 0)),
        int(model_states.get("dp_world_size", 1)),
        model_states,
        built,
        scalars,
        list(common.get("param_groups") or _base(common).get("param_groups", [])),
        common.get("loss_scaler"),
    )


def _universal_step(common: dict[str, Any]) -> tuple[float, torch.dtype | None] | None:
    state = _base(common).get("state", {}).get(0, {})
    return _scalar(state["step"]) if "step" in state else None


def _assemble(
    path: Path,
    stage: int,
    world: int,
    model_states: dict[str, Any],
    built: _Builder,
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]],
    groups: list[dict[str, Any]],
    loss_scaler: Any,
) -> ImportedCheckpoint:
    """The checkpoint's entries in the saved module's order, with the module's own values
    (the compute dtype at stages 0-2; stage 3 saves none) as ``param`` pieces, else the fp32
    masters."""
    buffer_names = set(model_states.get("buffer_names") or [])
    module = model_states["module"]
    masters = {p.name for p in built.pieces if p.kind == "master"}
    frozen = {p.name for p in built.pieces if p.kind == "param"}
    shapes = {n: s for group in model_states.get("param_shapes") or [] for n, s in group.items()}
    shapes |= dict(model_states.get("frozen_param_shapes") or {})
    tensors: dict[str, TensorEntry] = {}
    for name, value in module.items():
        if name in buffer_names:
            tensors[name] = TensorEntry("buffer", tuple(value.shape), value.dtype, False)
            built.whole("buffer", name, value, f"buffer/{name}")
            continue
        shape = tuple(shapes.get(name, value.shape))
        dtype = torch.float32 if name in masters else value.dtype
        tensors[name] = TensorEntry("param", shape, dtype, name in masters)
        if value.numel() == math.prod(shape) and name not in frozen:
            built.whole("param", name, value, f"module/{name}")
    for name, shape in shapes.items():  # parameters the module was saved without
        if name in masters and name not in tensors:
            tensors[name] = TensorEntry("param", tuple(shape), torch.float32, True)
    with_values = {p.name for p in built.pieces if p.kind == "param"}
    for piece in [p for p in built.pieces if p.kind == "master" and p.name not in with_values]:
        built.span("param", piece.name, piece.lo, piece.hi, piece.source, piece.offset)
    config = model_states.get("ds_config") or {}
    dtype = (
        torch.bfloat16
        if (config.get("bf16") or {}).get("enabled")
        else torch.float16
        if (config.get("fp16") or {}).get("enabled")
        else None
    )
    accumulation = int(config.get("gradient_accumulation_steps", 1) or 1)
    steps = int(model_states.get("global_steps", 0))
    state_keys = {p.kind for p in built.pieces if p.kind.startswith("optim.")}
    return ImportedCheckpoint(
        path=path,
        stage=stage,
        world_size=world,
        compute_dtype=dtype,
        tensors=tensors,
        sources=built.sources,
        pieces=built.pieces,
        aliases={
            k: v for k, v in (model_states.get("shared_params") or {}).items() if v in tensors
        },
        optimizer_type=_optimizer_name(config, state_keys) if state_keys else None,
        optimizer_scalars={n: v for n, v in scalars.items() if n in masters},
        groups=[{k: g[k] for k in GROUP_SETTINGS if k in g} for g in groups],
        scheduler=model_states.get("lr_scheduler"),
        loss_scaler=_loss_scaler(loss_scaler),
        global_steps=steps,
        global_samples=int(model_states.get("global_samples", 0)),
        skipped_steps=int(model_states.get("skipped_steps", 0)),
        micro_steps=steps * accumulation,
        model_states=model_states,
    )


def _optimizer_name(config: dict[str, Any], kinds: set[str]) -> str:
    """zerotrain's name for the optimizer that saved states ``kinds`` (``optim.exp_avg``...)."""
    declared = ((config.get("optimizer") or {}).get("type") or "").lower()
    states = {kind.removeprefix("optim.") for kind in kinds}
    if declared in _OPTIMIZERS:
        return _OPTIMIZERS[declared]
    if {"exp_avg", "exp_avg_sq"} <= states:
        return "Adam"  # a client optimizer of Adam's family
    if states == {"momentum_buffer"}:
        return "SGD"
    return declared or "+".join(sorted(states))


def _loss_scaler(saved: Any) -> dict[str, Any] | None:
    """DeepSpeed's fp16 loss scaler in zerotrain's terms (None for bf16's static 1.0)."""
    if not isinstance(saved, SavedLossScaler):
        return None
    attributes = saved.attributes()
    if not attributes.get("dynamic", False) and float(attributes.get("cur_scale", 1.0)) == 1.0:
        return None
    return {
        "scale": float(attributes["cur_scale"]),
        # Both count the clean steps since the last overflow (zerotrain's rule is DeepSpeed's).
        "clean_steps": int(attributes.get("cur_iter", 0))
        - int(attributes.get("last_overflow_iter", -1))
        - 1,
        "grace": int(attributes.get("cur_hysteresis", 1)),
    }
