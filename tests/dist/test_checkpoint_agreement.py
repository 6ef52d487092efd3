"""save_checkpoint is collective: ranks passing different directories, or a save called on
some ranks only (the ``if rank == 0:`` habit of single-file checkpoints), get a clear
error fast instead of a hang until the collective timeout (2 ranks, gloo and shared
memory)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

import zerotrain
from tests.helpers.training import (
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    zerotrain_config,
)
from zerotrain.testing.dist import BREAKS_THE_GROUP, run_distributed


def _engine():
    spec = RunSpec(steps=1, grad_accum=1, stage=2)
    engine, *_ = zerotrain.initialize(model=make_model(spec), config=zerotrain_config(spec, 2))
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    engine.backward(engine(x, y))
    engine.step()
    return engine


def _save_to_own_directory(root: str) -> str:
    engine = _engine()
    try:
        engine.save_checkpoint(str(Path(root) / f"rank{dist.get_rank()}"))
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_passing_different_directories_are_refused(tmp_path):
    for rank, message in enumerate(run_distributed(_save_to_own_directory, 2, str(tmp_path))):
        assert "save_dir" in message, (rank, message)
        assert "rank0" in message, message
        assert "rank1" in message, message
    assert not any(tmp_path.rglob("*.safetensors"))  # nothing was written


def _save_on_rank_0_only(root: str) -> dict:
    engine = _engine()
    spec = RunSpec(steps=1, grad_accum=1, stage=2)
    x, y = micro_batch(global_batches(spec, 2), spec, 0, 0, dist.get_rank(), 2)
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            engine.save_checkpoint(root)
        else:  # trains on: its next collective is a gradient reduction
            engine.backward(engine(x, y))
            engine.step()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_save_on_one_rank_only_fails_fast_on_both_ranks(tmp_path, shm):
    # Every collective is checked for the same signature on every rank (gloo and the
    # shared-memory arena): the saving rank's first one meets the other rank's gradient
    # reduction, and both stop with a message naming both, instead of waiting for the
    # collective timeout or exchanging mismatched data.
    env = {"ZEROTRAIN_SHM": shm}
    rank0, rank1 = run_distributed(
        _save_on_rank_0_only, 2, str(tmp_path), env=env, timeout=120, own_processes=BREAKS_THE_GROUP
    )
    for got in (rank0, rank1):
        assert got["error"] is not None, got
        assert "CollectiveError" in got["error"], got
        assert got["seconds"] < 30, got
    assert "save" in rank0["error"] or "checkpoint" in rank0["error"] or "control" in rank0["error"]
    assert "gradients" in rank0["error"] + rank1["error"], (rank0, rank1)
    assert not any(tmp_path.rglob("*.safetensors"))
