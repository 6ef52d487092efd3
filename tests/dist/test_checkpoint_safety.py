"""Checkpoint defects that lost or silently changed data: a crash while a tag is saved again,
flipped bits in any file (shards, manifest, client state, ``latest``), ranks given different
directories. Each test fails on the code before its fix."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import v1_fixture
from zerotrain.checkpoint import CheckpointError, CheckpointReader
from zerotrain.checkpoint import save as save_module
from zerotrain.checkpoint.directory import read_latest
from zerotrain.testing.dist import run_distributed

CLIENT = {"note": "client", "step": 2, "tensor": torch.arange(6, dtype=torch.float32)}


class _CrashError(Exception):
    """Stands for the process dying at this point."""


def _inject(point: str) -> None:
    """Make the next same-tag save stop at ``point`` (a process dying there leaves the same
    files: everything before it happened, nothing after)."""
    replace, rmtree = os.replace, shutil.rmtree

    def crashing_replace(src: Any, dst: Any) -> None:
        if point == "between_renames" and str(src).endswith(".partial"):
            raise _CrashError(point)  # final -> .old happened, .partial -> final did not
        # latest.sha256 is written first (it commits the save), then latest.
        if point == "before_latest" and Path(dst).name == "latest.sha256":
            raise _CrashError(point)
        if point == "between_pointers" and Path(dst).name == "latest":
            raise _CrashError(point)
        replace(src, dst)

    def crashing_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if point == "before_removing_old" and str(path).endswith(".old"):
            raise _CrashError(point)
        rmtree(path, *args, **kwargs)

    save_module.os.replace = crashing_replace  # type: ignore[assignment]
    save_module.shutil.rmtree = crashing_rmtree  # type: ignore[assignment]


def _crash_while_saving_again(root: str, point: str) -> dict[str, Any]:
    engine, loader = v1_fixture.build()
    batches = iter(loader)
    v1_fixture.train(engine, batches, 1)
    engine.save_checkpoint(root, tag="t")
    first = v1_fixture.full_params(engine)
    v1_fixture.train(engine, batches, 1)
    second = v1_fixture.full_params(engine)
    replace, rmtree = os.replace, shutil.rmtree
    _inject(point)
    try:
        engine.save_checkpoint(root, tag="t")
    except _CrashError:
        pass
    finally:
        save_module.os.replace, save_module.shutil.rmtree = replace, rmtree  # type: ignore[assignment]
    # A new process: what does the directory hold?
    expected = second if point in ("between_pointers", "before_removing_old") else first
    files = sorted(p.name for p in Path(root).iterdir())
    state = CheckpointReader.open(root)
    read_back = {n: state.tensor(n) for n in expected}
    fresh, _ = v1_fixture.build(seed=5)
    fresh.load_checkpoint(root)
    loaded = v1_fixture.full_params(fresh)
    # The next save finishes or undoes the interrupted one instead of deleting the only copy.
    fresh.save_checkpoint(root, tag="u")
    after = sorted(p.name for p in Path(root).iterdir())
    t_again = CheckpointReader.open(root, "t")
    return {
        "files": files,
        "read_back": all(torch.equal(read_back[n], v) for n, v in expected.items()),
        "loaded": all(torch.equal(loaded[n], v) for n, v in expected.items()),
        "after": after,
        "t_again": all(torch.equal(t_again.tensor(n), v) for n, v in expected.items()),
    }


@pytest.mark.parametrize(
    "point", ["between_renames", "before_latest", "between_pointers", "before_removing_old"]
)
def test_a_crash_while_saving_a_tag_again_keeps_a_complete_copy(tmp_path: Path, point: str) -> None:
    got = run_distributed(_crash_while_saving_again, 1, str(tmp_path), point)[0]
    assert ".t.old" in got["files"]  # the crash left the previous copy aside
    assert got["read_back"]
    assert got["loaded"]
    assert got["t_again"]
    assert got["after"] == ["latest", "latest.sha256", "t", "u"]  # nothing lost


def _save_with_client_state(root: str) -> None:
    engine, loader = v1_fixture.build()
    v1_fixture.train(engine, iter(loader), 2)
    engine.save_checkpoint(root, client_state=CLIENT)


def _positions(file: Path) -> list[int]:
    """Byte positions to flip: first, middle, last, and inside JSON numbers."""
    data = file.read_bytes()
    positions = {0, len(data) // 2, len(data) - 1}
    if file.name == "manifest.json":
        text = data.decode()
        for pattern in (r'"global_steps": (\d+)', r'"lr": ([\d.e-]+)', r'"bytes": (\d+)'):
            match = re.search(pattern, text)
            assert match, pattern
            positions.add(match.start(1) + len(match.group(1)) // 2)
        positions.add(text.index('"checksum": "sha256:') + 25)
    if file.name == "latest":  # the tag alone
        positions.add(1)
    if file.name == "latest.sha256":
        positions |= {1, data.index(b"sha256:") + 10}
    return sorted(positions)


def _load_all(root: Path) -> None:
    """Everything an engine load reads, in one process."""
    reader = CheckpointReader.open(root)
    reader.verify()
    for name in reader.manifest.tensors:
        reader.tensor(name)


def _engine_load(root: str) -> str:
    engine, _ = v1_fixture.build(seed=5)
    try:
        engine.load_checkpoint(root)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_every_flipped_byte_of_every_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    run_distributed(_save_with_client_state, 2, str(saved))
    tag = read_latest(saved).tag
    files = [*sorted((saved / tag).iterdir()), saved / "latest", saved / "latest.sha256"]
    names = {f.name for f in files}
    assert {"manifest.json", "client_state.pt", "rank00000.safetensors", "latest"} <= names
    checked = 0
    for original in files:
        for position in _positions(original):
            copy = tmp_path / f"{original.name}-{position}"
            shutil.copytree(saved, copy)
            target = copy / original.relative_to(saved)
            data = bytearray(target.read_bytes())
            data[position] ^= 0x01
            target.write_bytes(bytes(data))
            with pytest.raises(CheckpointError) as caught:
                _load_all(copy)
            assert str(target) in str(caught.value), (target, position, caught.value)
            checked += 1
    assert checked >= 4 * len(files)
    # Through the engine: every rank refuses, the rank that checked the file names it.
    for name in ("client_state.pt", "manifest.json"):
        copy = tmp_path / f"engine-{name}"
        shutil.copytree(saved, copy)
        target = copy / tag / name
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        messages = run_distributed(_engine_load, 2, str(copy))
        assert all(m != "loaded" for m in messages), messages
        assert any(str(target) in m for m in messages), messages


def _save_to_own_directory(root: str) -> str:
    engine, loader = v1_fixture.build()
    v1_fixture.train(engine, iter(loader), 1)
    try:
        engine.save_checkpoint(os.path.join(root, f"rank{engine.global_rank}"))
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_ranks_given_different_save_dirs_all_fail_naming_them(tmp_path: Path) -> None:
    messages = run_distributed(_save_to_own_directory, 2, str(tmp_path))
    for message in messages:
        assert "'save_dir'" in message, message
        assert str(tmp_path / "rank0") in message
        assert str(tmp_path / "rank1") in message
    assert list(tmp_path.iterdir()) == []  # nothing was written
