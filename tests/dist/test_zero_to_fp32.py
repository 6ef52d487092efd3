"""``zerotrain.utils.zero_to_fp32``: DeepSpeed's functions and script on checkpoints of the demo
GPT trained on 2 ranks (stage 3 in bf16 and stage 2 in fp32, one parameter frozen, two tags),
each called as DeepSpeed documents it and checked against the trained model exactly."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist

import zerotrain
from tests.helpers.training import RunSpec, make_model, train_steps, zerotrain_config
from zerotrain.checkpoint import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    load_state_dict_from_checkpoint,
)
from zerotrain.testing.dist import run_distributed
from zerotrain.utils.zero_to_fp32 import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

FROZEN = "wpe.weight"
TIED = ("wte.weight", "lm_head.weight")  # lm_head.weight is wte.weight
LATEST_TAG = "global_step3"
SMALL_SHARD = "20KB"  # wte.weight (32 KiB) alone, the blocks in several shards


def _with_buffers(model: torch.nn.Module) -> torch.nn.Module:
    """The demo GPT has none: a float buffer (fp32 out) and an integer one (kept int64)."""
    model.register_buffer("scale", torch.tensor([0.5, 0.25]))
    model.register_buffer("tokens_seen", torch.tensor(7, dtype=torch.int64))
    return model


def _gpt(spec: RunSpec) -> torch.nn.Module:
    return _with_buffers(zerotrain.examples.gpt.GPT(spec.model))


def _train_and_save(spec: RunSpec, path: str, precision: str | None) -> dict[str, Any] | None:
    model = _with_buffers(make_model(spec))
    config = zerotrain_config(spec, dist.get_world_size())
    if precision:
        config[precision] = {"enabled": True}
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    train_steps(engine, spec, 0, 2)
    with zerotrain.zero.GatheredParameters(model.parameters()):  # as held (bf16 under bf16)
        early = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.save_checkpoint(path, tag="early")
    train_steps(engine, spec, 2, 3)
    engine.save_checkpoint(path)
    engine.destroy()  # the model in fp32 again, with the master values
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"early": early, "final": final} if dist.get_rank() == 0 else None


@dataclasses.dataclass(frozen=True)
class Saved:
    path: Path
    early: dict[str, torch.Tensor]  # parameters as held when "early" was saved
    final: dict[str, torch.Tensor]  # the fp32 model when "global_step3" was saved
    spec: RunSpec


def _saved(tmp_path_factory: pytest.TempPathFactory, stage: int, precision: str | None) -> Saved:
    spec = RunSpec(stage=stage, steps=3, micro_batch=2, grad_accum=1, freeze=FROZEN)
    path = tmp_path_factory.mktemp(f"stage{stage}") / "ckpt"
    got = run_distributed(_train_and_save, 2, spec, str(path), precision)[0]
    return Saved(path, got["early"], got["final"], spec)


@pytest.fixture(scope="module")
def stage3_bf16(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return _saved(tmp_path_factory, 3, "bf16")


@pytest.fixture(scope="module")
def stage2(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return _saved(tmp_path_factory, 2, None)


@pytest.fixture(params=["stage3_bf16", "stage2"])
def saved(request: pytest.FixtureRequest) -> Saved:
    return request.getfixturevalue(request.param)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == (torch.float32 if value.is_floating_point() else value.dtype)
        assert torch.equal(got[key], value), key


def test_state_dict_is_the_trained_models_fp32_weights(saved: Saved) -> None:
    state_dict = get_fp32_state_dict_from_zero_checkpoint(saved.path)  # tag None: latest
    _assert_equal(state_dict, saved.final)
    assert state_dict[TIED[1]] is state_dict[TIED[0]]
    model = _gpt(saved.spec)
    model.load_state_dict(state_dict)  # strict, as DeepSpeed documents it
    for tag, where in [(LATEST_TAG, saved.path), (None, saved.path / LATEST_TAG)]:
        _assert_equal(get_fp32_state_dict_from_zero_checkpoint(where, tag), saved.final)
    early = get_fp32_state_dict_from_zero_checkpoint(saved.path, tag="early")
    assert not torch.equal(early[TIED[0]], state_dict[TIED[0]])
    for key, held in saved.early.items():  # under bf16: the masters, rounded as trained
        assert torch.equal(early[key].to(held.dtype), held), key
    assert not torch.equal(early[TIED[0]], early[TIED[0]].to(torch.bfloat16).float())


def test_exclude_frozen_parameters(saved: Saved) -> None:
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        saved.path, exclude_frozen_parameters=True
    )
    _assert_equal(state_dict, {k: v for k, v in saved.final.items() if k != FROZEN})


def test_lazy_mode_reads_each_tensor_on_contiguous(saved: Saved) -> None:
    lazy = get_fp32_state_dict_from_zero_checkpoint(saved.path, lazy_mode=True)
    assert list(lazy) == list(saved.final)
    assert lazy[TIED[1]] is lazy[TIED[0]]
    for name, lazy_tensor in lazy.items():  # DeepSpeed's documented loop
        assert isinstance(lazy_tensor, LazyTensor)
        assert lazy_tensor.shape == saved.final[name].shape
        assert lazy_tensor.dtype == (torch.int64 if name == "tokens_seen" else torch.float32)
        tensor = lazy_tensor.contiguous()
        assert torch.equal(tensor, saved.final[name]), name


def test_load_state_dict_from_zero_checkpoint(saved: Saved) -> None:
    torch.manual_seed(0)
    model = _gpt(saved.spec)
    assert load_state_dict_from_zero_checkpoint(model, saved.path) is model
    _assert_equal(model.state_dict(), saved.final)
    assert model.lm_head.weight is model.wte.weight
    load_state_dict_from_zero_checkpoint(model, saved.path, tag="early")
    held = saved.early[TIED[0]]
    assert torch.equal(model.wte.weight.to(held.dtype), held)


def _load_dir(out: Path, safe: bool) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Every tensor in ``out`` and the index's weight map (None without an index)."""
    name = "model.safetensors" if safe else "pytorch_model.bin"
    index = out / f"{name}.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    files = sorted(set(weight_map.values())) if weight_map else [name]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if safe:
            tensors |= safetensors.torch.load_file(out / file)
        else:
            tensors |= torch.load(out / file, weights_only=True)
    return tensors, weight_map


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_to_one_file(saved: Saved, tmp_path: Path, safe: bool) -> None:
    convert_zero_checkpoint_to_fp32_state_dict(saved.path, tmp_path, safe_serialization=safe)
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    tensors, _ = _load_dir(tmp_path, safe)
    model = _gpt(saved.spec)
    if safe:  # stored once, under its first name, as save_pretrained does
        assert TIED[1] not in tensors
        with safetensors.safe_open(tmp_path / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        _assert_equal(tensors, {k: v for k, v in saved.final.items() if k != TIED[1]})
        assert not safetensors.torch.load_model(model, tmp_path / name)[1]
    else:  # every name, one storage (torch.save keeps the sharing), as DeepSpeed writes it
        assert tensors[TIED[1]].data_ptr() == tensors[TIED[0]].data_ptr()
        assert sorted(tensors) == sorted(saved.final)
        _assert_equal({k: tensors[k] for k in saved.final}, saved.final)
        model.load_state_dict(tensors)
    _assert_equal(model.state_dict(), saved.final)


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_shards_like_hugging_face(saved: Saved, tmp_path: Path, safe: bool) -> None:
    hub = pytest.importorskip("huggingface_hub")
    convert_zero_checkpoint_to_fp32_state_dict(
        saved.path, tmp_path, max_shard_size=SMALL_SHARD, safe_serialization=safe, tag="early"
    )
    name = "model.safetensors" if safe else "pytorch_model.bin"
    index = json.loads((tmp_path / f"{name}.index.json").read_text())
    assert (tmp_path / f"{name}.index.json").read_text() == json.dumps(
        index, indent=2, sort_keys=True
    ) + "\n"
    # What DeepSpeed gets from huggingface_hub for the same state dict (tied names share a
    # tensor; safetensors keeps the first name only).
    expected = get_fp32_state_dict_from_zero_checkpoint(saved.path, tag="early")
    if safe:
        del expected[TIED[1]]
    split = hub.split_torch_state_dict_into_shards(
        expected, filename_pattern=name.replace(".", "{suffix}.", 1), max_shard_size=SMALL_SHARD
    )
    assert split.is_sharded
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*split.filename_to_tensors, f"{name}.index.json"]
    )
    assert len(split.filename_to_tensors) >= 4
    tensors, weight_map = _load_dir(tmp_path, safe)
    assert weight_map is not None
    assert sorted(weight_map) == sorted(expected)
    _assert_equal({k: tensors[k] for k in expected}, expected)
    # Converting again unsharded into the same directory removes the shards and the index.
    convert_zero_checkpoint_to_fp32_state_dict(saved.path, tmp_path, safe_serialization=safe)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_script(stage3_bf16: Saved, tmp_path: Path) -> None:
    saved = stage3_bf16
    out = tmp_path / "out"
    args = [str(saved.path), str(out), "--safe_serialization", "--exclude_frozen_parameters"]
    done = subprocess.run(
        [sys.executable, "-m", "zerotrain.utils.zero_to_fp32", *args, "--max_shard_size", "40KB"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    tensors, weight_map = _load_dir(out, safe=True)
    want = {k: v for k, v in saved.final.items() if k not in (FROZEN, TIED[1])}
    assert weight_map is not None
    assert sorted(weight_map) == sorted(want)
    _assert_equal({k: tensors[k] for k in want}, want)
    assert main([str(saved.path), str(tmp_path / "bin"), "-t", "early"]) == 0
    tensors, _ = _load_dir(tmp_path / "bin", safe=False)
    held = saved.early[TIED[0]]
    assert torch.equal(tensors[TIED[0]].to(held.dtype), held)
    assert main([str(tmp_path / "missing"), str(out)]) == 1
    with pytest.raises(SystemExit):
        main([str(saved.path), str(out), "--max_shard_size", "5 parsecs"])


def test_format_1_checkpoint() -> None:
    fixture = Path(__file__).resolve().parents[1] / "data" / "checkpoint-v1"
    want = load_state_dict_from_checkpoint(fixture)  # an fp32 run: the model's own dtypes
    got = get_fp32_state_dict_from_zero_checkpoint(fixture)
    assert got.keys() == want.keys()  # consolidate puts lm_head.weight after wte.weight
    _assert_equal(got, {key: want[key] for key in got})


def test_errors(stage2: Saved, tmp_path: Path) -> None:
    saved = stage2
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointNotFoundError, match=r"nope does not exist"):
        get_fp32_state_dict_from_zero_checkpoint(saved.path, tag="nope")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointNotFoundError, match="is not a zerotrain checkpoint directory"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="KB, MB, GB or TB"):
        convert_zero_checkpoint_to_fp32_state_dict(saved.path, tmp_path, max_shard_size="5 GiB")
    # DeepSpeed's layout (read as it is: tests/unit/test_deepspeed_import.py), its files
    # empty here.
    deepspeed = tmp_path / "ds"
    (deepspeed / "global_step5").mkdir(parents=True)
    (deepspeed / "latest").write_text("global_step5")
    for file in ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]:
        (deepspeed / "global_step5" / file).write_bytes(b"")
    for where, tag in [
        (deepspeed, None),
        (deepspeed, "global_step5"),
        (deepspeed / "global_step5", None),
    ]:
        with pytest.raises(CorruptCheckpointError, match=r"not a readable DeepSpeed file"):
            get_fp32_state_dict_from_zero_checkpoint(where, tag)
    assert main([str(deepspeed), str(tmp_path / "out")]) == 1
