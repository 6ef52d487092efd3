"""The checkpoint's file layer and the resumable sampler, in one process."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from zerotrain.checkpoint.directory import Latest, check_tag, read_latest, write_latest
from zerotrain.checkpoint.errors import CorruptCheckpointError
from zerotrain.checkpoint.safetensors_io import (
    SafetensorsReader,
    StreamingWriter,
    TensorSpec,
    file_crc32,
)
from zerotrain.engine.data import ResumableDistributedSampler


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0),
        "flag": torch.tensor([True, False]),
    }


def test_streamed_file_is_plain_safetensors_with_its_crc(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    writer = StreamingWriter(
        path, [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], {"k": "v"}
    )
    for key, value in tensors.items():
        writer.write(key, value)
    size, crc = writer.close()
    assert size == path.stat().st_size
    assert crc == file_crc32(path)
    loaded = safetensors.torch.load_file(path)
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype
        assert torch.equal(loaded[key], value)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_reader_copies_ranges_with_conversion(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    safetensors.torch.save_file(tensors, path)  # files written by the library read too
    reader = SafetensorsReader(path)
    out = torch.empty(6)
    reader.read_into("a", 4, out)
    assert torch.equal(out, tensors["a"].reshape(-1)[4:10])
    wide = torch.empty(5, dtype=torch.float32)  # stored bf16, read into fp32
    reader.read_into("b", 2, wide)
    assert torch.equal(wide, tensors["b"][2:7].float())
    with pytest.raises(CorruptCheckpointError, match="asked for"):
        reader.read_into("a", 10, torch.empty(6))


def test_writer_refuses_out_of_order_and_incomplete_files(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (3,))]
    writer = StreamingWriter(tmp_path / "x", specs)
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="b and later tensors were never written"):
        writer.close()


def test_truncated_header_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\xff" * 12)
    with pytest.raises(CorruptCheckpointError, match="not a readable safetensors file"):
        SafetensorsReader(path)


@pytest.mark.parametrize("tag", ["latest", ".hidden", "a/b", "", "x.partial"])
def test_bad_tags_are_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        check_tag(tag)


SHA = "sha256:" + "ab" * 32


def test_latest_holds_the_tag_alone_and_its_sibling_the_checksum(tmp_path: Path) -> None:
    write_latest(tmp_path, "global_step7", SHA)
    assert (tmp_path / "latest").read_text() == "global_step7"  # as DeepSpeed writes it
    assert (tmp_path / "latest.sha256").read_text().startswith(f"global_step7\nmanifest {SHA}\n")
    assert read_latest(tmp_path) == Latest("global_step7", SHA)


def test_latest_without_sibling_and_older_formats_are_read(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("global_step5")  # DeepSpeed's, or edited by hand
    assert read_latest(tmp_path) == Latest("global_step5", None)
    write_latest(tmp_path, "global_step7", SHA)
    # Before 2026-11-29 zerotrain wrote the three lines into latest itself.
    (tmp_path / "latest").write_text((tmp_path / "latest.sha256").read_text())
    (tmp_path / "latest.sha256").unlink()
    assert read_latest(tmp_path) == Latest("global_step7", SHA)


def _read_with_warnings(root: Path, caplog: pytest.LogCaptureFixture) -> Latest:
    logger = logging.getLogger("zerotrain")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            return read_latest(root)
    finally:
        logger.removeHandler(caplog.handler)


def test_when_the_two_differ_the_newer_file_wins_with_a_warning(tmp_path: Path, caplog) -> None:
    write_latest(tmp_path, "global_step7", SHA)
    latest, sibling = tmp_path / "latest", tmp_path / "latest.sha256"
    latest.write_text("global_step3\n")  # edited by hand after the save
    os.utime(sibling, ns=(1_000_000_000, 1_000_000_000))
    assert _read_with_warnings(tmp_path, caplog) == Latest("global_step3", None)
    assert "latest names global_step3, but was rewritten after the last save" in caplog.text
    caplog.clear()
    # latest older than its sibling: a save that ended between the two files (or a damaged
    # latest): the sibling, written last, names the committed checkpoint.
    os.utime(latest, ns=(1_000_000_000, 1_000_000_000))
    os.utime(sibling, ns=(2_000_000_000, 2_000_000_000))
    assert _read_with_warnings(tmp_path, caplog) == Latest("global_step7", SHA)
    assert "a save ended between the two files" in caplog.text


def test_a_damaged_sibling_is_refused_naming_it(tmp_path: Path) -> None:
    write_latest(tmp_path, "global_step7", SHA)
    sibling = tmp_path / "latest.sha256"
    sibling.write_text(sibling.read_text().replace("ab", "ac", 1))
    with pytest.raises(CorruptCheckpointError, match=r"latest\.sha256 is corrupt"):
        read_latest(tmp_path)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_resumes_at_the_same_global_position_for_any_world_size(drop_last: bool) -> None:
    """4 ranks draw 3 samples each; 2 ranks (or 3) resuming there see exactly the unseen
    samples of the same shuffle."""
    size = 37

    def draw(world: int, start: int, count: int | None = None) -> list[list[int]]:
        out = []
        for rank in range(world):
            sampler = ResumableDistributedSampler(size, rank, world, seed=5, drop_last=drop_last)
            sampler.epoch, sampler.start = 2, start
            out.append(list(sampler)[:count])
        return out

    first = draw(4, 0, 3)
    seen = {i for rank in first for i in rank}
    for world in (1, 2, 3):
        rest = draw(world, 12)
        unseen = [i for rank in rest for i in rank]
        assert not seen & set(unseen)
        assert set(unseen) | seen == set(range(size)) or drop_last
        assert len(rest[0]) == len(
            ResumableDistributedSampler(size - 12, 0, world, drop_last=drop_last)
        )
    whole = ResumableDistributedSampler(size, 0, 1, seed=5)
    whole.epoch = 2
    order = list(whole)
    assert [i for step in zip(*first, strict=True) for i in step] == order[:12]
