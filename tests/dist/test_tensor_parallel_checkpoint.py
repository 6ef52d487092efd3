"""Checkpoints of tensor-parallel jobs load into any other layout and continue the loss
trajectory.

Each case trains the demo GPT 3 steps in one layout (tensor x sequence x data, a ZeRO
stage), saves,
and trains 2 more steps; a job in another layout loads the checkpoint and trains the same 2
steps (same global batch, the data-parallel degree changes only the accumulation): its
losses must equal the first job's continuation within 1e-5. Tensor-parallel slices are
stored as boxes of the global tensors (the packed qkv as its block of each of q, k, v), so
any degree reads them, optimizer states included; ``zerotrain consolidate``'s reader
returns the dense tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tensor import (
    TensorRun,
    build_gpt,
    make_engine,
    pipeline_tensor_engine,
    train_pipeline_tensor,
    train_steps,
    whole_params,
)
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.testing.dist import run_distributed

SAVED_AT, CONTINUE_TO = 3, 5


def _save(run: TensorRun, path: str) -> dict:
    engine, model = make_engine(run)
    train_steps(engine, run, 0, SAVED_AT)
    engine.save_checkpoint(path, tag="tp")
    params = whole_params(engine, model)
    return {"losses": train_steps(engine, run, SAVED_AT, CONTINUE_TO), "params": params}


def _load(run: TensorRun, path: str) -> dict:
    engine, model = make_engine(run)
    engine.load_checkpoint(path, tag="tp")
    params = whole_params(engine, model)
    return {"losses": train_steps(engine, run, SAVED_AT, CONTINUE_TO), "params": params}


def _ranks(run: TensorRun) -> int:
    return run.world


CASES = [
    pytest.param(TensorRun(tensor=2, data=2), TensorRun(tensor=1, data=1), id="tp2xdp2-to-tp1"),
    pytest.param(TensorRun(tensor=1, zero_stage=2), TensorRun(tensor=2), id="tp1-to-tp2"),
    pytest.param(TensorRun(tensor=2), TensorRun(tensor=4, zero_stage=2), id="tp2-to-tp4"),
    pytest.param(
        TensorRun(tensor=2, data=2, zero_stage=3),
        TensorRun(tensor=1, data=1, zero_stage=3),
        id="stage3-tp2xdp2-to-tp1",
    ),
    pytest.param(
        TensorRun(tensor=2, zero_stage=3), TensorRun(tensor=4, zero_stage=3), id="stage3-tp2-to-tp4"
    ),
    # Ulysses: ZeRO shards over data x sequence; the model is whole on every sequence rank.
    pytest.param(
        TensorRun(tensor=2, sequence=2, zero_stage=2), TensorRun(tensor=1), id="sp2xtp2-to-tp1"
    ),
    pytest.param(
        TensorRun(tensor=1, zero_stage=3),
        TensorRun(tensor=1, sequence=2, data=2, zero_stage=3),
        id="stage3-dp1-to-sp2xdp2",
    ),
]


@pytest.mark.parametrize(("source", "target"), CASES)
def test_tensor_parallel_checkpoint_loads_in_another_layout(tmp_path, source, target):
    saved = run_distributed(_save, _ranks(source), source, str(tmp_path), timeout=300)[0]
    for rank, loaded in enumerate(
        run_distributed(_load, _ranks(target), target, str(tmp_path), timeout=300)
    ):
        for name, value in saved["params"].items():
            assert torch.equal(loaded["params"][name], value), (rank, name)
        worst = max(abs(a - b) for a, b in zip(loaded["losses"], saved["losses"], strict=True))
        assert worst < 1e-5, (rank, loaded["losses"], saved["losses"])


def test_consolidated_tensors_are_the_dense_model(tmp_path):
    run = TensorRun(tensor=2, data=2, zero_stage=2)
    saved = run_distributed(_save, 4, run, str(tmp_path), timeout=300)[0]
    reader = CheckpointReader(tmp_path / "tp")
    dense = build_gpt(run.model_config())
    for name, _ in dense.named_parameters():
        assert torch.equal(reader.tensor(name), saved["params"][name]), name


def _save_pipeline(path: str) -> list[float]:
    engine, _ = pipeline_tensor_engine(2, 2, heads=4)
    train_pipeline_tensor(engine, 0, SAVED_AT)
    engine.save_checkpoint(path, tag="pp")
    return train_pipeline_tensor(engine, SAVED_AT, CONTINUE_TO)


def _load_pipeline(path: str) -> list[float]:
    engine, _ = pipeline_tensor_engine(1, 4, heads=4)
    engine.load_checkpoint(path, tag="pp")
    return train_pipeline_tensor(engine, SAVED_AT, CONTINUE_TO)


def test_pipeline_by_tensor_checkpoint_loads_at_tensor_4(tmp_path):
    # PP=2 x TP=2 -> one stage at TP=4: each stage's blocks, at another split.
    saved = run_distributed(_save_pipeline, 4, str(tmp_path), timeout=300)
    loaded = run_distributed(_load_pipeline, 4, str(tmp_path), timeout=300)
    expected = saved[-1]  # the last stage reports the loss
    for rank, losses in enumerate(loaded):
        worst = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
        assert worst < 1e-5, (rank, losses, expected)
