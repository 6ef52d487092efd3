"""A DeepSpeed checkpoint behind the :class:`CheckpointReader` interface.

:mod:`deepspeed_import` describes DeepSpeed's files as pieces of whole tensors by name; here
they become a manifest as zerotrain's own checkpoints have (each piece one fragment, its
data a memory-mapped partition), so ``load_checkpoint`` fills any grid and any ZeRO stage
from it by the same code that loads zerotrain checkpoints, each rank reading only the
elements it keeps.
"""

from __future__ import annotations

import math
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
from zerotrain.config.policies import short_dtype_name

_FILE = "deepspeed"  # the one in-memory "file" every fragment points at


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype


class _MemoryFile:
    """The read interface of a safetensors file, over 1-D tensors in memory (or mapped)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.entries = {key: _Entry(t.dtype) for key, t in tensors.items()}

    def read_into(self, key: str, lo: int, out: torch.Tensor) -> None:
        out.copy_(self._tensors[key][lo : lo + out.numel()])

    def read(self, key: str) -> torch.Tensor:
        return self._tensors[key].clone()


class ImportedReader(CheckpointReader):
    """Reads an :class:`ImportedCheckpoint` as a zerotrain checkpoint."""

    foreign = True

    def __init__(self, imported: ImportedCheckpoint) -> None:
        super().__init__(imported.path, _manifest(imported))
        self.imported = imported
        self._files = {_FILE: _MemoryFile(imported.sources)}  # type: ignore[dict-item]

    def verify(self, files: Any = None) -> None:
        """Nothing to check: DeepSpeed writes no checksums, and the structure of every file
        was checked when the checkpoint was imported."""

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor | None:
        return None  # DeepSpeed saves no random states


def _place(name: str, shape: tuple[int, ...], lo: int, hi: int) -> dict[str, Any]:
    return {"name": name, "offsets": (0,) * len(shape), "lengths": shape, "lo": lo, "hi": hi}


def _manifest(imported: ImportedCheckpoint) -> Manifest:
    tensors = imported.tensors
    fragments = [
        Fragment(
            kind=p.kind,
            shape=tensors[p.name].shape,
            file=_FILE,
            key=p.source,
            offset=p.offset,
            **_place(p.name, tensors[p.name].shape, p.lo, p.hi),
        )
        for p in imported.pieces
    ]
    optimizer = None
    if imported.optimizer_type is not None:
        scalars = [
            SlotScalars(
                spans=(
                    Place(**_place(name, tensors[name].shape, 0, math.prod(tensors[name].shape))),
                ),
                values={
                    k: ScalarState(value=v, dtype=None if d is None else short_dtype_name(d))
                    for k, (v, d) in values.items()
                },
            )
            for name, values in imported.optimizer_scalars.items()
        ]
        optimizer = OptimizerInfo(
            type=imported.optimizer_type, groups=imported.groups, scalars=scalars
        )
    compute = imported.compute_dtype
    return Manifest(
        format=FORMAT,
        version=FORMAT_VERSION,
        tag=imported.path.name,
        created=imported.path.stat().st_mtime,
        topology=TopologyInfo(
            pipe=1,
            data=imported.world_size,
            tensor=1,
            sequence=1,
            order=("pipe", "data", "sequence", "tensor"),
        ),
        world_size=imported.world_size,
        stage=imported.stage,
        compute_dtype=None if compute is None else short_dtype_name(compute),
        global_steps=imported.global_steps,
        global_samples=imported.global_samples,
        micro_steps=imported.micro_steps,
        skipped_steps=imported.skipped_steps,
        tensors={
            name: TensorInfo(
                kind=entry.kind,
                shape=entry.shape,
                dtype=short_dtype_name(entry.dtype),
                trainable=entry.trainable,
            )
            for name, entry in tensors.items()
        },
        aliases=imported.aliases,
        files={},
        fragments=fragments,
        optimizer=optimizer,
        scheduler=imported.scheduler,
        loss_scaler=imported.loss_scaler,
        data=None,
        rng=[],
        client_state=None,
    )
