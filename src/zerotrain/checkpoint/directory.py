"""The save directory: checkpoint and temporary directory names, the ``latest`` pointer, and
recovery from a save that died while replacing a checkpoint of the same tag.

``SAVE_DIR/TAG/`` is a complete checkpoint. While one is written it is ``SAVE_DIR/.TAG.partial/``
(never loaded, removed by the next save). Saving a tag that already exists moves the old copy
to ``SAVE_DIR/.TAG.old/`` before the new one is renamed into place, and deletes it only after
``latest`` names the new one, so at every instant one complete copy of the tag exists under a
name that :func:`locate` finds and the next save's :func:`recover` completes or undoes.

``latest`` holds the tag alone, as DeepSpeed writes it (its ``zero_to_fp32.py``, its engine
and the scripts copied from them read ``open(latest).read().strip()``). Its sibling
``latest.sha256``, written just before it, holds the tag again, the SHA-256 of that
checkpoint's manifest and a CRC-32 of those two lines: a damaged sibling is refused naming
it, and a ``latest`` written before a same-tag checkpoint was replaced still finds the copy
it was written for. Where the two name different tags, the newer file wins, with a warning:
``latest`` when it was rewritten after the save (by hand, or by another tool), the sibling
otherwise (a save that ended between the two files, or a damaged ``latest``).
Checkpoints saved before 2026-11-29 have the three lines in ``latest`` itself (format 2);
they are read as they are, and so are directories with a ``latest`` alone (DeepSpeed's).
"""

from __future__ import annotations

import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from zerotrain.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from zerotrain.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    fsync_dir,
    read_manifest,
    write_text_atomically,
)
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

LATEST = "latest"
LATEST_CHECKSUM = "latest.sha256"
PARTIAL_SUFFIX = ".partial"
OLD_SUFFIX = ".old"
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]*")
_SHA = re.compile(r"sha256:[0-9a-f]{64}")


def shard_file(rank: int) -> str:
    """Name of the file global rank ``rank`` writes."""
    return f"rank{rank:05d}.safetensors"


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint directory, else ValueError."""
    if not _TAG.fullmatch(tag) or tag == LATEST or tag.endswith((PARTIAL_SUFFIX, OLD_SUFFIX)):
        raise ValueError(
            f"checkpoint tag {tag!r} is not allowed: use letters, digits and _ . = + - (not "
            f"starting with '.' or '-'), other than '{LATEST}' and not ending in "
            f"'{PARTIAL_SUFFIX}' or '{OLD_SUFFIX}'"
        )
    return tag


def partial_dir(root: Path, tag: str) -> Path:
    """Where checkpoint ``tag`` is written before it is complete."""
    return root / f".{tag}{PARTIAL_SUFFIX}"


def old_dir(root: Path, tag: str) -> Path:
    """Where the previous copy of ``tag`` waits while a new one replaces it."""
    return root / f".{tag}{OLD_SUFFIX}"


@dataclass(frozen=True, slots=True)
class Latest:
    """What ``latest`` says: a tag and, from format 2 on, its manifest's checksum."""

    tag: str
    manifest_checksum: str | None


def _latest_body(tag: str, checksum: str) -> str:
    return f"{tag}\nmanifest {checksum}\n"


def write_latest(root: Path, tag: str, manifest_checksum: str) -> None:
    """Point ``root/latest`` at checkpoint ``tag`` whose manifest has ``manifest_checksum``:
    first its checksum file, then ``latest`` (the tag alone), each atomically."""
    body = _latest_body(tag, manifest_checksum)
    checked = f"{body}crc32 {zlib.crc32(body.encode()):08x}\n"
    write_text_atomically(root / LATEST_CHECKSUM, checked)
    write_text_atomically(root / LATEST, tag)


def read_latest(root: Path) -> Latest:
    """The tag ``root/latest`` names and, where ``latest.sha256`` was written with it, the
    manifest checksum to verify; CorruptCheckpointError naming the damaged file."""
    latest = _read_pointer(root / LATEST)
    sibling = root / LATEST_CHECKSUM
    if latest.manifest_checksum is not None or not sibling.is_file():
        return latest  # format 2 (the checksum inside), or no checksum written (DeepSpeed's)
    checked = _read_pointer(sibling)
    if checked.manifest_checksum is None:
        raise CorruptCheckpointError(f"{sibling} is corrupt: it holds a tag alone")
    if checked.tag == latest.tag:
        return checked
    if (root / LATEST).stat().st_mtime_ns > sibling.stat().st_mtime_ns:
        log.warning(
            "%s names %s, but was rewritten after the last save wrote %s (which names %s): "
            "loading %s, as %s says, without the manifest check",
            root / LATEST,
            latest.tag,
            sibling,
            checked.tag,
            latest.tag,
            LATEST,
        )
        return latest
    log.warning(
        "%s names %s, but %s, written by the last save after it, names %s (a save ended "
        "between the two files, or %s was damaged): loading %s",
        root / LATEST,
        latest.tag,
        sibling,
        checked.tag,
        LATEST,
        checked.tag,
    )
    return checked


def _read_pointer(pointer: Path) -> Latest:
    """Parse and verify a pointer file: the tag alone (format 1) or tag, manifest checksum
    and CRC-32 (format 2); CorruptCheckpointError naming it if it is damaged."""
    raw = pointer.read_bytes()
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{pointer} is corrupt: not ASCII text ({exc})") from exc
    lines = text.split("\n")
    if len(lines) == 1 or (len(lines) == 2 and lines[1] == ""):  # format 1: the tag alone
        tag = lines[0].strip()
        if not _TAG.fullmatch(tag):
            raise CorruptCheckpointError(f"{pointer} is corrupt: {tag!r} is not a tag")
        return Latest(tag, None)
    if len(lines) != 4 or lines[3] != "" or not lines[2].startswith("crc32 "):
        raise CorruptCheckpointError(
            f"{pointer} is corrupt: expected 3 lines (tag, 'manifest sha256:...', 'crc32 ...')"
        )
    body = f"{lines[0]}\n{lines[1]}\n"
    stored = lines[2].removeprefix("crc32 ")
    if stored != f"{zlib.crc32(body.encode()):08x}":
        raise CorruptCheckpointError(
            f"{pointer} is corrupt: its CRC-32 {stored!r} does not match its content "
            f"({zlib.crc32(body.encode()):08x})"
        )
    checksum = lines[1].removeprefix("manifest ")
    if not _TAG.fullmatch(lines[0]) or not _SHA.fullmatch(checksum):
        raise CorruptCheckpointError(f"{pointer} is corrupt: cannot parse {body!r}")
    return Latest(lines[0], checksum)


def _complete(path: Path) -> Manifest | None:
    """The verified manifest of ``path``, or None where it is not a complete checkpoint."""
    if not (path / MANIFEST).is_file():
        return None
    try:
        return read_manifest(path)
    except CheckpointError:
        return None


def locate(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, Manifest]:
    """The directory of checkpoint ``tag`` under ``load_dir`` (the one ``latest`` names when
    ``tag`` is None) and its verified manifest. ``load_dir`` may also be a checkpoint
    directory itself. A checkpoint whose replacement by a same-tag save was interrupted is
    found in its ``.TAG.old`` copy."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    expected: str | None = None
    named_by = "checkpoint"  # how the error names a missing directory
    if tag is None:
        if (root / MANIFEST).is_file():
            return root, read_manifest(root)
        pointer = root / LATEST
        if not pointer.is_file() and any(root.glob("rank*.safetensors")):
            raise CheckpointNotFoundError(
                f"{root} holds shard files but no {MANIFEST}: an incomplete checkpoint (its "
                "save was interrupted)"
            )
        if not pointer.is_file():
            complete = sorted(p.parent.name for p in root.glob(f"[!.]*/{MANIFEST}"))
            raise CheckpointNotFoundError(
                f"{pointer} does not exist, so no checkpoint is marked as the latest; pass a "
                f"tag (complete checkpoints here: {complete or 'none'})"
            )
        latest = read_latest(root)
        tag, expected = latest.tag, latest.manifest_checksum
        named_by = f"{pointer} names checkpoint {tag}, but"
    path, old = root / tag, old_dir(root, tag)
    if expected is None:
        if path.is_dir():
            return path, read_manifest(path)
        if (manifest := _complete(old)) is not None:
            log.warning("%s is missing; loading its previous copy %s", path, old)
            return old, manifest
        raise CheckpointNotFoundError(f"{named_by} {path} does not exist")
    found = read_manifest(path) if path.is_dir() else None  # a damaged manifest names itself
    if found is not None and found.checksum == expected:
        return path, found
    if (manifest := _complete(old)) is not None and manifest.checksum == expected:
        log.warning("%s names %s; loading it from %s", root / LATEST, tag, old)
        return old, manifest
    if found is None:
        raise CheckpointNotFoundError(
            f"{root / LATEST} names checkpoint {tag}, but {path} does not exist"
        )
    raise CorruptCheckpointError(
        f"{root / LATEST} names checkpoint {tag} with manifest {expected}, but "
        f"{path / MANIFEST} has {found.checksum}: {root / LATEST} is stale or corrupt; pass "
        f"tag={tag!r} to load {path} anyway"
    )


def recover(root: Path) -> None:
    """Finish or undo a same-tag replacement that a crash interrupted (rank 0, at the start
    of a save), then remove ``.partial`` directories: none of them was ever committed (a
    complete one whose rename never happened is not what ``latest`` or any tag names)."""
    for old in root.glob(f".*{OLD_SUFFIX}"):
        tag = old.name[1 : -len(OLD_SUFFIX)]
        path = root / tag
        if not path.exists():
            os.replace(old, path)  # the new copy never arrived: the old one is the checkpoint
            log.warning("restored checkpoint %s from %s (a save of it was interrupted)", path, old)
        elif (manifest := _complete(path)) is not None and manifest.checksum is not None:
            # The new copy was renamed into place: finish that save (latest, then the old copy).
            write_latest(root, tag, manifest.checksum)
            shutil.rmtree(old)
            log.warning("completed the interrupted save of %s (removed %s)", path, old)
        else:
            log.warning("left %s and %s for a person to inspect: neither is usable", path, old)
    for stale in root.glob(f".*{PARTIAL_SUFFIX}"):
        shutil.rmtree(stale)  # left by an interrupted save
    fsync_dir(root)
