"""A DeepSpeed checkpoint behind the :class:`CheckpointReader` interface.

:mod:`deepspeed_import` turns DeepSpeed's files into whole tensors by name; here they get a
manifest as zerotrain's own checkpoints have (every tensor one fragment covering all of it,
held in memory), so ``load_checkpoint`` fills any grid and any ZeRO stage from it by the same
code that loads zerotrain checkpoints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.checkpoint.deepspeed_import import ImportedCheckpoint
from zerotrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    Fragment,
    Manifest,
    OptimizerInfo,
    Place,
    ScalarState,
    SlotScalars,
    TensorInfo,
    TopologyInfo,
)
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.config.policies import DTYPE_BY_NAME

_FILE = "deepspeed"  # the one in-memory "file" every fragment points at
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return _NAME_OF_DTYPE.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype


class _MemoryFile:
    """The read interface of a safetensors file, over tensors in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = {key: t.detach().reshape(-1) for key, t in tensors.items()}
        self.entries = {key: _Entry(t.dtype) for key, t in self._tensors.items()}

    def read_into(self, key: str, lo: int, out: torch.Tensor) -> None:
        out.copy_(self._tensors[key][lo : lo + out.numel()])

    def read(self, key: str) -> torch.Tensor:
        return self._tensors[key].clone()


class ImportedReader(CheckpointReader):
    """Reads an :class:`ImportedCheckpoint` as a zerotrain checkpoint."""

    foreign = True

    def __init__(self, imported: ImportedCheckpoint) -> None:
        tensors: dict[str, torch.Tensor] = {}
        manifest = _manifest(imported, tensors)
        super().__init__(imported.path, manifest)
        self.imported = imported
        self._files = {_FILE: _MemoryFile(tensors)}  # type: ignore[dict-item]

    def verify(self, files: Any = None) -> None:
        """Nothing to check: DeepSpeed writes no checksums, and every file was read whole
        (its structure checked) when the checkpoint was imported."""

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor | None:
        return None  # DeepSpeed saves no random states


def _place(name: str, shape: tuple[int, ...]) -> dict[str, Any]:
    return {
        "name": name,
        "offsets": (0,) * len(shape),
        "lengths": shape,
        "lo": 0,
        "hi": math.prod(shape),
    }


def _manifest(imported: ImportedCheckpoint, tensors: dict[str, torch.Tensor]) -> Manifest:
    """The manifest of ``imported``; fills ``tensors`` with the data it points at."""
    infos: dict[str, TensorInfo] = {}
    fragments: list[Fragment] = []

    def add(kind: str, name: str, value: torch.Tensor) -> None:
        shape = tuple(value.shape)
        key = f"{kind}/{name}"
        tensors[key] = value
        place = _place(name, shape)
        fragments.append(Fragment(kind=kind, shape=shape, file=_FILE, key=key, offset=0, **place))

    params = {**imported.frozen, **imported.masters, **imported.module}
    saved_order = [n for n in imported.model_states.get("module", {}) if n in params]
    for name in saved_order + [n for n in params if n not in set(saved_order)]:
        value = imported.module.get(name, imported.masters.get(name, imported.frozen.get(name)))
        assert value is not None
        dtype = torch.float32 if name in imported.masters else value.dtype
        infos[name] = TensorInfo(
            kind="param",
            shape=tuple(value.shape),
            dtype=_dtype_name(dtype),
            trainable=name in imported.masters,
        )
        add("param", name, value)
        if name in imported.masters:
            add("master", name, imported.masters[name])
    for name, value in imported.buffers.items():
        shape = tuple(value.shape)
        infos[name] = TensorInfo(kind="buffer", shape=shape, dtype=_dtype_name(value.dtype))
        add("buffer", name, value)
    for key, by_name in imported.optimizer_states.items():
        for name, value in by_name.items():
            add(f"optim.{key}", name, value)
    optimizer = None
    if imported.optimizer_type is not None:
        optimizer = OptimizerInfo(
            type=imported.optimizer_type,
            groups=imported.groups,
            scalars=[
                SlotScalars(
                    spans=(Place(**_place(name, tuple(imported.masters[name].shape))),),
                    values={
                        k: ScalarState(value=v, dtype=None if d is None else _dtype_name(d))
                        for k, (v, d) in values.items()
                    },
                )
                for name, values in imported.optimizer_scalars.items()
                if name in imported.masters
            ],
        )
    return Manifest(
        format=FORMAT,
        version=FORMAT_VERSION,
        tag=imported.path.name,
        created=imported.path.stat().st_mtime if imported.path.exists() else time.time(),
        topology=TopologyInfo(
            pipe=1,
            data=imported.world_size,
            tensor=1,
            sequence=1,
            order=("pipe", "data", "sequence", "tensor"),
        ),
        world_size=imported.world_size,
        stage=imported.stage,
        compute_dtype=None if (compute := imported.compute_dtype) is None else _dtype_name(compute),
        global_steps=imported.global_steps,
        global_samples=imported.global_samples,
        micro_steps=imported.micro_steps,
        skipped_steps=imported.skipped_steps,
        tensors=infos,
        aliases={k: v for k, v in imported.aliases.items() if v in infos},
        files={},
        fragments=fragments,
        optimizer=optimizer,
        scheduler=imported.scheduler,
        loss_scaler=imported.loss_scaler,
        data=None,
        rng=[],
        client_state=None,
    )
