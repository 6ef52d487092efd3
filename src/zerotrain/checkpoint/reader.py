"""Reading a checkpoint by (kind, name, region of the global tensor), whatever grid wrote it.

This is the one module that needs to know the on-disk format to read it; the engine loader
and the consolidation tool both go through it.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

from zerotrain.checkpoint.boxes import Region, overlap, shared_count
from zerotrain.checkpoint.directory import locate, shard_file
from zerotrain.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError
from zerotrain.checkpoint.manifest import Fragment, Manifest, read_manifest
from zerotrain.checkpoint.safetensors_io import SafetensorsReader, file_crc32
from zerotrain.utils.invariant import invariant


class CheckpointReader:
    """Random access to the tensors of checkpoint directory ``path``."""

    foreign = False  # another system's checkpoint, read through an adapter (DeepSpeed's)

    def __init__(self, path: Path, manifest: Manifest | None = None) -> None:
        self.path = path
        self.manifest = manifest or read_manifest(path)
        index: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
        for fragment in self.manifest.fragments:
            index[fragment.kind, fragment.name].append(fragment)
        for fragments in index.values():
            fragments.sort(key=lambda f: (f.offsets, f.lo))
        self._index = dict(index)
        self._files: dict[str, SafetensorsReader] = {}

    @classmethod
    def open(cls, load_dir: str | os.PathLike[str], tag: str | None = None) -> CheckpointReader:
        """The checkpoint ``tag`` under ``load_dir`` (default: the one ``latest`` names),
        its manifest verified."""
        return cls(*locate(load_dir, tag))

    def _file(self, name: str) -> SafetensorsReader:
        if name not in self._files:
            path = self.path / name
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path} is missing from the checkpoint")
            self._files[name] = SafetensorsReader(path)
        return self._files[name]

    def verify(self, files: Iterable[str] | None = None) -> None:
        """Check size and CRC-32 of ``files`` (default: all) against the manifest."""
        for name in files if files is not None else self.manifest.files:
            info = self.manifest.files[name]
            path = self.path / name
            if not path.is_file():
                raise CheckpointNotFoundError(f"{path} is missing from the checkpoint")
            size = path.stat().st_size
            if size != info.bytes:
                raise CorruptCheckpointError(
                    f"{path} is {size} bytes, the manifest says {info.bytes} (truncated or "
                    "overwritten)"
                )
            crc = file_crc32(path)
            if crc != info.crc32:
                raise CorruptCheckpointError(
                    f"{path} is corrupt: CRC-32 {crc:#010x}, the manifest says {info.crc32:#010x}"
                )

    def stored_name(self, name: str) -> str | None:
        """The name ``name``'s data is stored under: itself, or the parameter it was tied to
        when saved (a model that unties them starts both from the saved values)."""
        if name in self.manifest.tensors:
            return name
        return self.manifest.aliases.get(name)

    def kinds(self) -> set[str]:
        """Every kind of data stored (``param``, ``master``, ``optim.exp_avg``, ...)."""
        return {kind for kind, _ in self._index}

    def whole(self, name: str, lo: int, hi: int) -> Region:
        """Elements ``[lo, hi)`` of the flattened whole tensor ``name``."""
        return Region.of(tuple(self.manifest.tensors[name].shape), lo, hi)

    def covers(self, kind: str, name: str, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` of flattened ``name`` is stored as ``kind`` in full."""
        return self.covers_region(kind, name, self.whole(name, lo, hi))

    def covers_region(self, kind: str, name: str, region: Region) -> bool:
        """Whether every element of ``region`` of ``name`` is stored as ``kind`` (the saved
        fragments of one kind never overlap: the manifest merge drops replicated copies)."""
        found = sum(shared_count(f.region(), region) for f in self._index.get((kind, name), []))
        return found >= region.numel

    def dtype(self, kind: str, name: str) -> torch.dtype | None:
        """The dtype ``name`` is stored in as ``kind`` (None if it is not stored)."""
        fragments = self._index.get((kind, name))
        if not fragments:
            return None
        return self._file(fragments[0].file).entries[fragments[0].key].dtype

    def read_into(
        self, kind: str, name: str, lo: int, out: torch.Tensor, *, partial: bool = False
    ) -> int:
        """Fill ``out`` (1-D) with elements ``[lo, lo + out.numel())`` of flattened ``name``
        stored as ``kind``; returns how many elements were found. Unless ``partial``, every
        element must be stored."""
        region = self.whole(name, lo, lo + out.numel())
        return self.read_region_into(kind, name, region, out, partial=partial)

    def read_region_into(
        self, kind: str, name: str, region: Region, out: torch.Tensor, *, partial: bool = False
    ) -> int:
        """Fill ``out`` (1-D, ``region.numel`` elements) with ``region`` of ``name`` stored as
        ``kind``: the intersection of each saved fragment with it. Returns how many elements
        were found; unless ``partial``, every element must be stored."""
        invariant(out.numel() == region.numel, f"{out.numel()} elements for {region}")
        found = 0
        for f in self._index.get((kind, name), []):
            runs = overlap(f.region(), region)
            if not runs:
                continue
            reader = self._file(f.file)
            for run in runs:
                reader.read_into(
                    f.key, f.offset + run.source, out[run.target : run.target + run.length]
                )
                found += run.length
        if not partial and found < region.numel:
            raise CorruptCheckpointError(
                f"{self.path}: the manifest lists only {found} of the {region.numel} elements "
                f"of {kind} '{name}' in {region}"
            )
        return found

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (fp32 master values where saved, else as stored)."""
        info = self.manifest.tensors[name]
        kind = info.kind
        if kind == "param" and self.covers("master", name, 0, math.prod(info.shape)):
            kind = "master"
        return self.stored_tensor(kind, name, dtype)

    def stored_tensor(self, kind: str, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` stored as ``kind`` (``optim.exp_avg``, ...), in
        ``dtype`` (default: as stored)."""
        shape = self.manifest.tensors[name].shape
        stored = self.dtype(kind, name)
        if stored is None:
            raise CorruptCheckpointError(f"{self.path}: no {kind} data for '{name}'")
        out = torch.empty(math.prod(shape), dtype=dtype or stored)
        self.read_into(kind, name, 0, out)
        return out.view(shape)

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor | None:
        """A tensor stored under ``key`` in rank ``rank``'s file (RNG states)."""
        reader = self._file(shard_file(rank))
        return reader.read(key) if key in reader.entries else None
