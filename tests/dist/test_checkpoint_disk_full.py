"""A checkpoint save onto a disk that is full (issue 29, item 4), on a real small tmpfs.

Before, the save failed with "u2.param and later tensors were never written" (the writer's
close masking the write's ENOSPC) and left ``.global_stepN.partial`` behind. Now the ranks
compare what they will write with the free space before writing: every rank raises, the
ones on the full disk with "no space left on device", the path, the bytes needed and free;
the partial directory is removed; the job can save elsewhere and go on.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import zerotrain
from tests.helpers.faults import small_tmpfs
from zerotrain.checkpoint.save import _write_shard
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.testing.dist import run_distributed

TINY_DISK = 256 * 1024  # bytes; the GPT's checkpoint needs several MiB


def _save_to_full_then_elsewhere(full: str, roomy: str) -> dict:
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(
        model=GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=64)),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 1},
        },
    )
    tokens = torch.randint(0, 256, (2, 17))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    try:
        engine.save_checkpoint(full)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    saved = engine.save_checkpoint(roomy)  # the job goes on
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    return {"error": error, "saved": saved}


def test_a_full_disk_is_named_before_writing_and_nothing_is_left(tmp_path: Path):
    with small_tmpfs(tmp_path / "full", TINY_DISK) as full:
        results = run_distributed(
            _save_to_full_then_elsewhere, 2, str(full), str(tmp_path / "roomy"), timeout=120
        )
        left = sorted(p.name for p in full.iterdir())
    for rank, r in enumerate(results):
        message = r["error"]
        assert message is not None, f"rank {rank}: the save onto a full disk succeeded"
        assert "no space left on device" in message, message
        assert str(full) in message, message
        assert "need" in message, message
        assert "free" in message, message
        assert Path(r["saved"]).is_dir()
    assert left == [], f"the failed save left {left} behind"


def test_a_disk_that_fills_while_writing_reports_enospc(tmp_path: Path):
    with small_tmpfs(tmp_path / "full", TINY_DISK) as full:
        # Another program takes most of the space after any check could have run.
        (full / "ballast").write_bytes(b"\0" * (TINY_DISK - 16 * 1024))
        with pytest.raises(OSError) as caught:
            _write_shard(full / "rank00000.safetensors", {"w": torch.zeros(64 * 1024)})
    assert caught.value.errno == errno.ENOSPC, caught.value  # not "never written"
