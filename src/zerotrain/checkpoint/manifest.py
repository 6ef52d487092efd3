"""A checkpoint's manifest (JSON): what is stored where, and the checksums that verify it.

A checkpoint is ``SAVE_DIR/TAG/`` holding ``manifest.json``, one ``rankNNNNN.safetensors``
per saving rank (by global rank) and, if given, ``client_state.pt``. Every tensor element is
addressed by kind and name plus a region of the global tensor: ``kind`` is ``param``,
``master`` (fp32 master weights), ``buffer`` or ``optim.<state>`` (an element-wise optimizer
state such as ``optim.exp_avg``); the region is a box of the global tensor (per-dimension
offsets and lengths) and a flat range of that box (``checkpoint/boxes.py``). The manifest's
``fragments`` say which file and key hold each region, so a loader with any grid and any
ZeRO stage reads exactly the elements it needs.

Format 1 (one data-parallel group, 1-D ranges of whole tensors) is read by upgrading its
manifest to format 2's model: every range becomes a flat range of the whole-tensor box.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from zerotrain.checkpoint.boxes import Box, Region
from zerotrain.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError

FORMAT = "zerotrain-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"
# The manifest's checksum is the SHA-256 of the file as written with this placeholder in
# place of the checksum itself, so every byte of the file is covered, whitespace included.
_PLACEHOLDER = "sha256:" + "0" * 64
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorInfo(_Model):
    """One entry of the model's state dict."""

    kind: str  # "param" or "buffer"
    shape: tuple[int, ...]
    dtype: str  # the model's own dtype (before any mixed-precision cast)
    trainable: bool = False


class FileInfo(_Model):
    """Size and CRC-32 of one file of the checkpoint."""

    bytes: int
    crc32: int


class Fragment(_Model):
    """Elements ``[lo, hi)`` of the box (``offsets``, ``lengths``) of global tensor ``name``
    (of ``kind``, global ``shape``) are stored in ``file`` under ``key``, from element
    ``offset``."""

    kind: str
    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    lo: int
    hi: int
    file: str
    key: str
    offset: int

    def region(self) -> Region:
        """The elements this fragment holds."""
        return Region(Box(self.offsets, self.lengths), self.lo, self.hi)


class Place(_Model):
    """A region of global tensor ``name``: flat range ``[lo, hi)`` of a box."""

    name: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    lo: int
    hi: int

    def region(self) -> Region:
        """The elements of the place."""
        return Region(Box(self.offsets, self.lengths), self.lo, self.hi)


class TopologyInfo(_Model):
    """The grid that saved the checkpoint (``zerotrain.parallel.Topology``)."""

    pipe: int
    data: int
    tensor: int
    sequence: int
    order: tuple[str, ...]


class ScalarState(_Model):
    """A per-tensor optimizer scalar (Adam's step count): its value, and whether the
    optimizer held it as a 0-d tensor (of ``dtype``) or a Python number."""

    value: float
    dtype: str | None = None


class SlotScalars(_Model):
    """Scalar optimizer states of one optimizer tensor, and the parameter regions that
    tensor covered."""

    spans: tuple[Place, ...]
    values: dict[str, ScalarState]


class OptimizerInfo(_Model):
    """What the optimizer was, its param groups' settings, and its scalar states."""

    type: str
    groups: list[dict[str, Any]]
    scalars: list[SlotScalars]
    # The parameter names of each group, in the model's order (None: saved before 2026-11-29).
    members: list[list[str]] | None = None


def scalar_by_name(optimizer: OptimizerInfo, key: str) -> dict[str, float]:
    """Optimizer scalar ``key`` (Adam's ``step``) of each parameter: the value saved for
    most of its elements (they differ only where some pieces skipped steps unused)."""
    best: dict[str, tuple[int, float]] = {}
    for slot in optimizer.scalars:
        scalar = slot.values.get(key)
        if scalar is None:
            continue
        for place in slot.spans:
            covered = place.hi - place.lo
            if covered > best.get(place.name, (0, 0.0))[0]:
                best[place.name] = (covered, scalar.value)
    return {name: value for name, (_, value) in best.items()}


class Manifest(_Model):
    """Everything about a checkpoint except the tensor data."""

    format: str
    version: int
    tag: str
    created: float
    topology: TopologyInfo
    world_size: int  # every rank of the job: one shard file and one random state each
    stage: int
    compute_dtype: str | None
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    tensors: dict[str, TensorInfo]
    aliases: dict[str, str]
    files: dict[str, FileInfo]
    fragments: list[Fragment]
    optimizer: OptimizerInfo | None
    scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any] | None
    data: dict[str, Any] | None
    rng: list[dict[str, Any]]  # by global rank
    client_state: str | None
    # By global rank: each one's rank-local optimizer state (checkpoint/rank_local.py).
    rank_local: list[dict[str, Any] | None] | None = None
    checksum: str | None = None  # None only in format 1, which had none


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so a reader sees
    either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomically(path: Path, value: Any) -> None:
    """:func:`write_text_atomically` of ``value`` as JSON."""
    write_text_atomically(path, json.dumps(value, indent=1))


def fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _field(checksum: str) -> str:
    return f'"checksum": "{checksum}"'


def write_manifest(path: Path, manifest: dict[str, Any]) -> str:
    """Write ``manifest`` (without its checksum) to ``path/manifest.json`` with its checksum
    inside; returns the checksum."""
    text = json.dumps({**manifest, "checksum": _PLACEHOLDER}, indent=1)
    checksum = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    write_text_atomically(path / MANIFEST, text.replace(_field(_PLACEHOLDER), _field(checksum), 1))
    return checksum


def _verify_checksum(file: Path, text: str, raw: dict[str, Any]) -> None:
    stored = raw.get("checksum")
    if not isinstance(stored, str) or not _CHECKSUM.fullmatch(stored):
        raise CorruptCheckpointError(f"{file} is corrupt: no valid checksum field ({stored!r})")
    if text.count(_field(stored)) != 1:
        raise CorruptCheckpointError(f"{file} is corrupt: its checksum field is malformed")
    actual = hashlib.sha256(text.replace(_field(stored), _field(_PLACEHOLDER)).encode())
    if "sha256:" + actual.hexdigest() != stored:
        raise CorruptCheckpointError(
            f"{file} is corrupt: its content has SHA-256 {actual.hexdigest()}, the checksum "
            f"stored in it is {stored.removeprefix('sha256:')}"
        )


def _upgrade_v1(file: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """A format-1 manifest in format 2's terms: one data-parallel group of ``world_size``
    ranks, every range a flat range of the whole tensor."""
    try:
        shapes = {name: list(t["shape"]) for name, t in raw["tensors"].items()}
        fragments = [
            {**f, "shape": shapes[f["name"]], "offsets": [0] * len(shapes[f["name"]])}
            | {"lengths": shapes[f["name"]]}
            for f in raw["fragments"]
        ]
        optimizer = raw["optimizer"]
        if optimizer is not None:
            scalars = [
                {
                    "spans": [
                        {"name": n, "offsets": [0] * len(shapes[n]), "lengths": shapes[n]}
                        | {"lo": lo, "hi": hi}
                        for n, lo, hi in entry["spans"]
                    ],
                    "values": entry["values"],
                }
                for entry in optimizer["scalars"]
            ]
            optimizer = {**optimizer, "scalars": scalars}
        topology = {"pipe": 1, "data": raw["world_size"], "tensor": 1, "sequence": 1}
        topology["order"] = ["pipe", "data", "sequence", "tensor"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file}: malformed format-1 manifest: {exc!r}") from exc
    return {**raw, "fragments": fragments, "optimizer": optimizer, "topology": topology}


def read_manifest(path: Path) -> Manifest:
    """The verified manifest of checkpoint directory ``path`` (format 1 or 2)."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointNotFoundError(
            f"{file} does not exist: {path} is not a complete zerotrain checkpoint (a save "
            "that was interrupted leaves no manifest)"
        )
    try:
        text = file.read_bytes().decode()
        raw = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{file}: not a zerotrain checkpoint manifest")
    if raw.get("version") not in READABLE_VERSIONS:
        raise CorruptCheckpointError(
            f"{file}: format version {raw.get('version')}, this zerotrain reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if raw["version"] >= 2:
        _verify_checksum(file, text, raw)
    else:
        raw = _upgrade_v1(file, raw)
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise CorruptCheckpointError(f"{file}: malformed manifest: {exc}") from exc
