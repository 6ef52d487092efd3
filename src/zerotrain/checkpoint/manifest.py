"""The checkpoint directory: its manifest (JSON), file names, and the ``latest`` pointer.

A checkpoint is ``SAVE_DIR/TAG/`` holding ``manifest.json``, one ``rankNNNNN.safetensors``
per saving rank and, if given, ``client_state.pt``. Every tensor element is addressed by
(kind, name, range of the flattened tensor): ``kind`` is ``param``, ``master`` (fp32 master
weights), ``buffer`` or ``optim.<state>`` (an element-wise optimizer state such as
``optim.exp_avg``). The manifest's ``fragments`` say which file and key hold each range,
so a loader with any number of ranks and any ZeRO stage reads exactly the ranges it needs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from zerotrain.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError

FORMAT = "zerotrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CLIENT_STATE = "client_state.pt"
PARTIAL_SUFFIX = ".partial"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]*")


def shard_file(rank: int) -> str:
    """Name of the file rank ``rank`` writes."""
    return f"rank{rank:05d}.safetensors"


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint directory, else ValueError."""
    if not _TAG.fullmatch(tag) or tag == LATEST or tag.endswith(PARTIAL_SUFFIX):
        raise ValueError(
            f"checkpoint tag {tag!r} is not allowed: use letters, digits and _ . = + - (not "
            f"starting with '.' or '-'), other than '{LATEST}' and not ending in "
            f"'{PARTIAL_SUFFIX}'"
        )
    return tag


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
    """Elements ``[lo, hi)`` of flattened ``name`` (of ``kind``) are stored in ``file`` under
    ``key``, starting at element ``offset``."""

    kind: str
    name: str
    lo: int
    hi: int
    file: str
    key: str
    offset: int


class ScalarState(_Model):
    """A per-tensor optimizer scalar (Adam's step count): its value, and whether the
    optimizer held it as a 0-d tensor (of ``dtype``) or a Python number."""

    value: float
    dtype: str | None = None


class SlotScalars(_Model):
    """Scalar optimizer states of one optimizer tensor, and the parameter ranges that tensor
    covered (``[name, lo, hi]``)."""

    spans: tuple[tuple[str, int, int], ...]
    values: dict[str, ScalarState]


class OptimizerInfo(_Model):
    """What the optimizer was, its param groups' settings, and its scalar states."""

    type: str
    groups: list[dict[str, Any]]
    scalars: list[SlotScalars]


class Manifest(_Model):
    """Everything about a checkpoint except the tensor data."""

    format: str
    version: int
    tag: str
    created: float
    world_size: int
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
    rng: list[dict[str, Any]]
    client_state: str | None


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


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint directory ``path``."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointNotFoundError(
            f"{file} does not exist: {path} is not a complete zerotrain checkpoint (a save "
            "that was interrupted leaves no manifest)"
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{file}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{file}: not a zerotrain checkpoint manifest")
    if raw.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{file}: format version {raw.get('version')}, this zerotrain reads version "
            f"{FORMAT_VERSION}"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise CorruptCheckpointError(f"{file}: malformed manifest: {exc}") from exc


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The directory of checkpoint ``tag`` under ``load_dir`` (the one ``latest`` names
    when ``tag`` is None). ``load_dir`` may also be a checkpoint directory itself."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    if tag is None:
        if (root / MANIFEST).is_file():
            return root
        pointer = root / LATEST
        if not pointer.is_file() and any(root.glob("rank*.safetensors")):
            raise CheckpointNotFoundError(
                f"{root} holds shard files but no {MANIFEST}: an incomplete checkpoint (its "
                "save was interrupted)"
            )
        if not pointer.is_file():
            found = sorted(p.parent.name for p in root.glob(f"*/{MANIFEST}"))
            raise CheckpointNotFoundError(
                f"{pointer} does not exist, so no checkpoint is marked as the latest; pass a "
                f"tag (complete checkpoints here: {found or 'none'})"
            )
        tag = pointer.read_text().strip()
    path = root / tag
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    return path
