"""Checkpoints written by the release before format 2 (``tests/data/checkpoint-v1``) load
unchanged and continue training exactly where the saving run went on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors.torch
import torch

from tests.helpers import v1_fixture
from zerotrain.checkpoint import CheckpointReader, load_state_dict_from_checkpoint
from zerotrain.testing.dist import run_distributed

FIXTURE = Path(__file__).parent.parent / "data" / "checkpoint-v1"


def _copy(tmp_path: Path) -> Path:
    # Loading must not write into the fixture; a copy keeps the repository clean anyway.
    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, target)
    return target


def test_v1_checkpoint_resumes_exactly_as_the_saving_run_continued(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    expected = json.loads((FIXTURE / "expected.json").read_text())
    saved = load_state_dict_from_checkpoint(path)
    got = run_distributed(v1_fixture.resume, 2, str(path))
    assert got[0]["path"] == str(path / v1_fixture.TAG)
    assert got[0]["client"] == expected["client_state"]
    params = safetensors.torch.load_file(FIXTURE / "expected_params.safetensors")
    for rank in got:
        # The load itself is exact: every parameter bit for bit as the fixture stored it.
        # (named_parameters lists the tied head once, as wte.weight; the state dict has both.)
        assert rank["restored"].keys() == saved.keys() - {"lm_head.weight"}
        for name, value in rank["restored"].items():
            assert torch.equal(value, saved[name]), name
        # The 3 steps after it ran on the machine that wrote the fixture; another CPU's
        # kernels (AVX-512 against AVX2 matmuls and Adam) round differently in the last bit,
        # so the continuation is compared at float32 rounding (seen: 1 ulp, 1e-8 absolute),
        # far below what a wrongly restored moment or step count moves (~lr = 3e-3).
        torch.testing.assert_close(rank["losses"], expected["losses"], rtol=1e-6, atol=0)
        assert rank["params"].keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_v1_checkpoint_consolidates(tmp_path: Path) -> None:
    from zerotrain.cli.main import main

    path = _copy(tmp_path)
    reader = CheckpointReader.open(path)
    assert reader.manifest.version == 1
    state = load_state_dict_from_checkpoint(path)
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(path), str(out)]) == 0
    loaded = safetensors.torch.load_file(out)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    model = v1_fixture.GPT(v1_fixture.MODEL)
    model.load_state_dict(loaded)
