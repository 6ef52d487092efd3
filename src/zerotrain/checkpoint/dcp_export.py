"""A zerotrain checkpoint written in ``torch.distributed.checkpoint`` (DCP) format, for
torchtitan and plain-PyTorch (FSDP2, DTensor) users.

The layout is torchtitan's: the model's tensors at the top level by their names (fp32
master values where saved), the optimizer under ``optimizer`` as torch's flattened
optimizer state dict (``get_optimizer_state_dict(...,
StateDictOptions(flatten_optimizer_state_dict=True))``: ``state.NAME.exp_avg``,
``state.NAME.step``, ``param_groups.NAME.lr``, ...), which ``set_optimizer_state_dict``
loads into a torch optimizer, and zerotrain's counters and schedule under ``zerotrain``.

Written one tensor at a time: DCP plans the save from shapes alone (meta tensors), and the
planner reads each tensor from the checkpoint when the writer asks for it.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from zerotrain.checkpoint.errors import IncompatibleCheckpointError
from zerotrain.checkpoint.manifest import scalar_by_name
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


class _ReadWhenWritten(DefaultSavePlanner):
    """Plans over meta tensors; hands the writer each tensor read from the checkpoint."""

    def __init__(self, read: dict[str, Any]) -> None:
        super().__init__()
        self._read = read  # flattened key -> function returning the tensor

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self._read:
            return self._read[index.fqn]()
        return super().lookup_object(index)


def export_dcp(
    load_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None
) -> Path:
    """Write zerotrain checkpoint ``tag`` of ``load_dir`` (default: the latest) as a DCP
    checkpoint in ``out_dir``; returns it.

    Raises:
        CheckpointError: the checkpoint is missing or corrupt (every file is verified first).
        IncompatibleCheckpointError: optimizer states whose param groups were not recorded
            (checkpoints saved before 2026-11-29 with more than one group).
    """
    reader = CheckpointReader.open(load_dir, tag)
    reader.verify()
    manifest = reader.manifest
    layout: dict[str, Any] = {}
    read: dict[str, Any] = {}

    def lazy(key: str, shape: tuple[int, ...], dtype: torch.dtype, fetch: Any) -> torch.Tensor:
        read[key] = fetch
        return torch.empty(shape, dtype=dtype, device="meta")

    for name, info in manifest.tensors.items():
        stored = reader.dtype("param" if info.kind == "param" else info.kind, name)
        dtype = torch.float32 if info.kind == "param" and info.trainable else stored
        layout[name] = lazy(
            name, info.shape, dtype or torch.float32, lambda n=name, d=dtype: reader.tensor(n, d)
        )
    if manifest.optimizer is not None:
        layout["optimizer"] = _optimizer(reader, lazy)
    layout["zerotrain"] = {
        "global_steps": manifest.global_steps,
        "global_samples": manifest.global_samples,
        "skipped_steps": manifest.skipped_steps,
        "lr_scheduler": manifest.scheduler,
        "loss_scaler": manifest.loss_scaler,
        "optimizer_type": manifest.optimizer.type if manifest.optimizer is not None else None,
    }
    out = Path(out_dir)
    with warnings.catch_warnings():
        # One process writes every tensor: no process group is needed, as DCP then warns.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        dcp.save(
            layout,
            storage_writer=dcp.FileSystemWriter(out, thread_count=1),
            planner=_ReadWhenWritten(read),
        )
    log.info(
        "wrote %s: %d tensors as a DCP checkpoint, step %d", out, len(read), manifest.global_steps
    )
    return out


def _optimizer(reader: CheckpointReader, lazy: Any) -> dict[str, Any]:
    """torch's flattened optimizer state dict, its tensors lazy."""
    manifest = reader.manifest
    info = manifest.optimizer
    assert info is not None
    trainable = [n for n, t in manifest.tensors.items() if t.kind == "param" and t.trainable]
    members = info.members
    if members is None:
        if len(info.groups) != 1:
            raise IncompatibleCheckpointError(
                f"{reader.path} was saved before zerotrain recorded which parameters each of "
                f"its {len(info.groups)} param groups holds; resave it (load and save) to "
                "export its optimizer"
            )
        members = [trainable]
    flat: dict[str, Any] = {}
    states = sorted(k for k in reader.kinds() if k.startswith("optim."))
    steps = scalar_by_name(info, "step")
    for name in trainable:
        shape = manifest.tensors[name].shape
        numel = math.prod(shape)
        for kind in states:
            if reader.covers(kind, name, 0, numel):
                key = kind.removeprefix("optim.")
                fetch = functools.partial(reader.stored_tensor, kind, name, torch.float32)
                flat[f"state.{name}.{key}"] = lazy(
                    f"optimizer.state.{name}.{key}", shape, torch.float32, fetch
                )
        if name in steps:
            flat[f"state.{name}.step"] = torch.tensor(steps[name], dtype=torch.float32)
    for group, names in zip(info.groups, members, strict=True):
        settings = _torch_settings(info.type, group, reader)
        for name in names:
            for key, value in settings.items():
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def _torch_settings(kind: str, group: dict[str, Any], reader: CheckpointReader) -> dict[str, Any]:
    """A param group's settings under the names torch's optimizer of the same kind uses
    (zerotrain's Adam is torch's AdamW, or Adam without ``adam_w_mode``); other optimizers'
    settings as they are."""
    if kind != "Adam":
        return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
    if not group.get("bias_correction", True):
        raise IncompatibleCheckpointError(
            f"{reader.path}: Adam without bias correction has no torch optimizer to continue "
            "it; export the weights with `zerotrain consolidate`"
        )
    return {
        "lr": group["lr"],
        "betas": tuple(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "amsgrad": group.get("amsgrad", False),
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": group.get("adam_w_mode", True),
    }
