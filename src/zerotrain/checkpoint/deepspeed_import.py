"""DeepSpeed checkpoints read into whole tensors by parameter name.

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

Every rank reads the whole checkpoint (the full model and optimizer in fp32, once, in host
memory); a model too large for that is converted once with ``zerotrain convert-deepspeed``.
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
_STAGE3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
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
_GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


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
        for pointer in (LATEST_UNIVERSAL, LATEST):
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


@dataclass
class ImportedCheckpoint:
    """A DeepSpeed checkpoint as whole tensors by name."""

    path: Path
    stage: int
    world_size: int
    compute_dtype: torch.dtype | None
    module: dict[str, torch.Tensor]  # the module's values as saved (in the compute dtype)
    masters: dict[str, torch.Tensor]  # fp32 master weights of the trainable parameters
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    aliases: dict[str, str]  # tied parameter -> the one saved
    optimizer_type: str | None  # zerotrain's name for it; None: no optimizer states
    optimizer_states: dict[str, dict[str, torch.Tensor]]  # state -> name -> whole tensor
    optimizer_scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]]  # name -> ...
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


GroupNames = Callable[[], list[list[str]]]


def read_deepspeed_checkpoint(
    load_dir: Path, tag: str | None, group_names: GroupNames | None = None
) -> ImportedCheckpoint:
    """Read DeepSpeed checkpoint ``tag`` under ``load_dir`` (or the one ``latest`` /
    ``latest_universal`` names; ``load_dir`` may be the tag directory itself).
    ``group_names`` gives the parameter names of each of the loading job's param groups, in
    order: stage-0 checkpoints need it to name their optimizer states."""
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
    first = _as_dict(load_deepspeed_file(optim_files[0]))["optimizer_state_dict"]
    stage = int(first["zero_stage"])
    world = _world_size(first, optim_files)
    optims = [first] + [
        _as_dict(load_deepspeed_file(f))["optimizer_state_dict"] for f in optim_files[1:]
    ]
    shapes = _param_shapes(model_states, path)
    if stage == 3:
        frozen_parts = [
            _as_dict(load_deepspeed_file(f)).get("frozen_param_fragments") or {}
            for f in model_files
        ]
        masters, states = _stage3(shapes, optims, world, path)
        frozen = _stage3_frozen(model_states, frozen_parts)
        module: dict[str, torch.Tensor] = {}
    else:
        masters, states = _stage12(shapes, optims, path)
        frozen = dict(model_states.get("frozen_param_fragments") or {})
        module = dict(model_states["module"])
    base = first.get("base_optimizer_state") or first.get("optimizer_state_dict") or {}
    scalars = _scalars_by_name(shapes, base, stage)
    return _assemble(
        path,
        stage,
        world,
        model_states,
        module,
        masters,
        frozen,
        states,
        scalars,
        base.get("param_groups", []),
        first.get("loss_scaler"),
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


def _param_shapes(model_states: dict[str, Any], path: Path) -> list[dict[str, torch.Size]]:
    shapes = model_states.get("param_shapes")
    if not shapes:
        raise CorruptCheckpointError(f"{path}: the model states lack param_shapes")
    return [dict(group) for group in shapes]


def _stage12(
    shapes: list[dict[str, torch.Size]], optims: list[dict[str, Any]], path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Stages 1-2: each group's partitions concatenated, cut by name."""
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    paddings = optims[0].get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        parts = [o["single_partition_of_fp32_groups"][g] for o in optims]
        flat = torch.cat(parts)
        # Optimizer states keep each partition's padding; the fp32 partitions are saved
        # without it, so their lengths say how much of each state is real.
        per_state: dict[str, torch.Tensor] = {}
        for key in _element_keys(optims[0], g, parts[0].numel()):
            pieces = zip(optims, parts, strict=True)
            per_state[key] = torch.cat(
                [_base(o)["state"][g][key].reshape(-1)[: p.numel()] for o, p in pieces]
            )
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CorruptCheckpointError(
                    f"{path}: param group {g} holds {flat.numel()} elements, fewer than its "
                    f"parameters need (at {name})"
                )
            masters[name] = flat[offset : offset + numel].view(tuple(shape))
            for key, value in per_state.items():
                states.setdefault(key, {})[name] = value[offset : offset + numel].view(tuple(shape))
            offset += numel + (paddings[g][i] if paddings else 0)
    return masters, states


def _base(optim: dict[str, Any]) -> dict[str, Any]:
    return optim.get("base_optimizer_state") or optim.get("optimizer_state_dict") or {}


def _element_keys(optim: dict[str, Any], index: int, numel: int) -> list[str]:
    """The optimizer's element-wise states of sub-group ``index`` (tensors of the
    partition's length; 0-d ones such as ``step`` are scalars)."""
    state = _base(optim).get("state", {}).get(index, {})
    return [
        key
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() >= numel
    ]


def _stage3(
    shapes: list[dict[str, torch.Size]], optims: list[dict[str, Any]], world: int, path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Stage 3: each rank's sub-groups concatenated hold every parameter's partition in turn."""

    def per_rank(optim: dict[str, Any]) -> dict[str, torch.Tensor]:
        flat_groups = optim["fp32_flat_groups"]
        out = {"fp32": torch.cat([t.reshape(-1) for t in flat_groups])}
        state = _base(optim).get("state", {})
        for key in _element_keys(optim, 0, flat_groups[0].numel()):
            out[key] = torch.cat(
                [state[i][key].reshape(-1)[: t.numel()] for i, t in enumerate(flat_groups)]
            )
        return out

    ranks = [per_rank(o) for o in optims]
    names = {n: s for group in shapes for n, s in group.items()}
    wanted = sum(math.ceil(math.prod(s) / world) for s in names.values())
    if ranks[0]["fp32"].numel() != wanted:
        raise CorruptCheckpointError(
            f"{path}: each rank's stage-3 partition holds {ranks[0]['fp32'].numel()} elements; "
            f"the parameters in param_shapes need {wanted}"
        )
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for name, shape in names.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        for key in ranks[0]:
            whole = torch.cat([r[key][offset : offset + part] for r in ranks])[:numel]
            value = whole.view(tuple(shape))
            if key == "fp32":
                masters[name] = value
            else:
                states.setdefault(key, {})[name] = value
        offset += part
    return masters, states


def _stage3_frozen(
    model_states: dict[str, Any], parts: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    frozen = {}
    for name, shape in (model_states.get("frozen_param_shapes") or {}).items():
        numel = math.prod(shape)
        frozen[name] = torch.cat([p[name].reshape(-1) for p in parts])[:numel].view(tuple(shape))
    return frozen


def _scalars_by_name(
    shapes: list[dict[str, torch.Size]], base: dict[str, Any], stage: int
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
    module = dict(model_states["module"])
    optimizer = model_states.get("optimizer")
    states: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]] = {}
    groups: list[dict[str, Any]] = []
    if isinstance(optimizer, Mapping) and "param_groups" in optimizer:
        groups = list(optimizer["param_groups"])
        names = group_names() if group_names is not None else None
        if names is None or len(names) != len(groups):
            raise IncompatibleCheckpointError(
                f"{path}: a DeepSpeed checkpoint without ZeRO names no parameters in its "
                f"optimizer state ({len(groups)} param group(s)); zerotrain matches them by "
                f"position within the job's own param groups, and this job has "
                f"{'none' if names is None else len(names)}. Load with "
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
                saved = optimizer["state"].get(index, {})
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        if name in module and value.shape != module[name].shape:
                            raise IncompatibleCheckpointError(
                                f"{path}: optimizer state {key} of parameter #{index} has shape "
                                f"{list(value.shape)}, but {name}, the parameter at its place in "
                                f"this job's group {g}, has {list(module[name].shape)}: the "
                                "groups list parameters in another order; load with "
                                "load_optimizer_states=False"
                            )
                        states.setdefault(key, {})[name] = value
                    else:
                        scalars.setdefault(name, {})[key] = _scalar(value)
    buffers = set(model_states.get("buffer_names") or [])
    trainable = {n: t for n, t in module.items() if n not in buffers}
    masters = {n: t.float() for n, t in trainable.items() if t.is_floating_point()}
    return _assemble(
        path,
        0,
        int(model_states.get("dp_world_size", 1)),
        model_states,
        module,
        masters,
        {},
        states,
        scalars,
        groups,
        None,
    )


def _read_universal(path: Path) -> ImportedCheckpoint:
    """``ds_to_universal`` output: every parameter whole under ``zero/NAME/``."""
    model_states = _as_dict(load_deepspeed_file(path / MODEL_STATES))
    shapes = _param_shapes(model_states, path)
    common = _as_dict(load_deepspeed_file(path / "zero" / "optimizer_state.pt"))
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]] = {}
    for group in shapes:
        for name, shape in group.items():
            folder = path / "zero" / name
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
                value = value.reshape(tuple(shape))
                if key == "fp32":
                    masters[name] = value
                else:
                    states.setdefault(key, {})[name] = value
            if name not in masters:
                raise CorruptCheckpointError(f"{folder / 'fp32.pt'} is missing")
    return _assemble(
        path,
        int(common.get("zero_stage", 0)),
        int(model_states.get("dp_world_size", 1)),
        model_states,
        dict(model_states["module"]),
        masters,
        {},
        states,
        scalars,
        list(common.get("param_groups", [])),
        common.get("loss_scaler"),
    )


def _assemble(
    path: Path,
    stage: int,
    world: int,
    model_states: dict[str, Any],
    module: dict[str, torch.Tensor],
    masters: dict[str, torch.Tensor],
    frozen: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    scalars: dict[str, dict[str, tuple[float, torch.dtype | None]]],
    groups: list[dict[str, Any]],
    loss_scaler: Any,
) -> ImportedCheckpoint:
    buffer_names = set(model_states.get("buffer_names") or [])
    buffers = {n: t for n, t in model_states["module"].items() if n in buffer_names}
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
    return ImportedCheckpoint(
        path=path,
        stage=stage,
        world_size=world,
        compute_dtype=dtype,
        module={n: t for n, t in module.items() if n not in buffer_names and t.numel() > 0},
        masters=masters,
        buffers=buffers,
        frozen=frozen,
        aliases=dict(model_states.get("shared_params") or {}),
        optimizer_type=_optimizer_name(config, states) if states else None,
        optimizer_states=states,
        optimizer_scalars=scalars,
        groups=[{k: g[k] for k in _GROUP_SETTINGS if k in g} for g in groups],
        scheduler=model_states.get("lr_scheduler"),
        loss_scaler=_loss_scaler(loss_scaler),
        global_steps=steps,
        global_samples=int(model_states.get("global_samples", 0)),
        skipped_steps=int(model_states.get("skipped_steps", 0)),
        micro_steps=steps * accumulation,
        model_states=model_states,
    )


def _optimizer_name(config: dict[str, Any], states: dict[str, Any]) -> str:
    declared = ((config.get("optimizer") or {}).get("type") or "").lower()
    if declared in _OPTIMIZERS:
        return _OPTIMIZERS[declared]
    if {"exp_avg", "exp_avg_sq"} <= set(states):
        return "Adam"  # a client optimizer of Adam's family
    if set(states) == {"momentum_buffer"}:
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
        # DeepSpeed counts clean steps from the last overflow and doubles at each multiple of
        # the window; zerotrain counts from the last change of scale.
        "clean_steps": (
            int(attributes.get("cur_iter", 0)) - int(attributes.get("last_overflow_iter", -1)) - 1
        )
        % max(1, int(attributes.get("scale_window", 1000))),
        "grace": int(attributes.get("cur_hysteresis", 1)),
    }
