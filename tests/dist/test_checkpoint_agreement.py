"""save_checkpoint is collective: ranks passing different directories, or a save called on
some ranks only (the ``if rank == 0:`` habit of single-file checkpoints), get a clear
error fast instead of a hang until the collective timeout (2 ranks)."""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

import zerotrain
from tests.helpers.training import (
    RunSpec,
    global_batches,
    make_model,
    micro_batch,
    zerotrain_config,
)
from zerotrain.testing.dist import run_distributed


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
    if dist.get_rank() != 0:
        return {"error": None, "seconds": 0.0}
    start = time.monotonic()
    try:
        engine.save_checkpoint(root)
    except RuntimeError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"error": "no error", "seconds": time.monotonic() - start}


def test_a_save_on_one_rank_only_fails_fast_naming_the_missing_rank(tmp_path):
    env = {"ZEROTRAIN_CHECKPOINT_ARRIVAL_TIMEOUT": "3"}
    rank0, rank1 = run_distributed(_save_on_rank_0_only, 2, str(tmp_path), env=env)
    assert "rank(s) 1 of 2 did not call it within 3 s" in rank0["error"]
    assert "not under 'if rank == 0'" in rank0["error"]
    assert rank0["seconds"] < 15
    assert rank1["error"] is None
    assert not any(tmp_path.rglob("*.safetensors"))
