"""Sharded checkpoints on real process groups: exact resume, resharding across world sizes
and stages, atomicity under SIGKILL, corruption and mismatch errors, consolidation."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import zerotrain
from tests.helpers.training import (
    PARITY_ADAM,
    TINY,
    RunSpec,
    global_batches,
    make_model,
    train_steps,
    zerotrain_config,
)
from zerotrain.checkpoint import (
    CheckpointNotFoundError,
    CheckpointReader,
    CorruptCheckpointError,
    load_state_dict_from_checkpoint,
    regions,
)
from zerotrain.checkpoint.directory import read_latest
from zerotrain.checkpoint.safetensors_io import StreamingWriter
from zerotrain.testing.dist import DistributedTestError, run_distributed

DROPOUT = dataclasses.replace(TINY, dropout=0.1)


def _config(spec: RunSpec, world: int, precision: str | None) -> dict[str, Any]:
    config = zerotrain_config(spec, world)
    config["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 5, "total_num_steps": 40},
    }
    if precision:
        config[precision] = {"enabled": True}
    if precision == "fp16":
        config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 4})
    return config


def _dataset(spec: RunSpec) -> TensorDataset:
    windows = global_batches(dataclasses.replace(spec, steps=30, grad_accum=1), 4).flatten(0, 1)
    return TensorDataset(windows[:, :-1], windows[:, 1:])


def _build(spec: RunSpec, precision: str | None, seed_offset: int = 0):
    torch.manual_seed(1234 + seed_offset)
    model = zerotrain.examples.gpt.GPT(spec.model)
    engine, _, loader, _ = zerotrain.initialize(
        model=model,
        config=_config(spec, dist.get_world_size(), precision),
        training_data=_dataset(spec),
    )
    return model, engine, loader


class _Batches:
    """Batches drawn from the loader, epoch after epoch, as a training loop would."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.it = iter(loader)

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def _train(engine, batches: _Batches, steps: int) -> list[float]:
    """Global mean losses of ``steps`` optimizer steps."""
    losses = []
    gas = engine.gradient_accumulation_steps()
    while len(losses) < steps:
        total = 0.0
        for _ in range(gas):
            x, y = next(batches)
            total += engine.backward(engine(x, y)).item()
            engine.step()
        losses.append(engine.comm.all_reduce_floats([total])[0])
    return losses


def _train_save_train(spec: RunSpec, precision: str | None, path: str) -> list[float]:
    _, engine, loader = _build(spec, precision)
    batches = _Batches(loader)
    _train(engine, batches, 10)
    engine.save_checkpoint(path, client_state={"note": "ten steps", "step": 10})
    return _train(engine, batches, 10)


def _load_train(spec: RunSpec, precision: str | None, path: str) -> dict[str, Any]:
    # A different initialisation and RNG: everything must come from the checkpoint.
    _, engine, loader = _build(spec, precision, seed_offset=77)
    torch.manual_seed(5)
    loaded, client = engine.load_checkpoint(path)
    return {"losses": _train(engine, _Batches(loader), 10), "client": client, "path": loaded}


@pytest.mark.parametrize("precision", [None, "bf16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_continues_bitwise(tmp_path: Path, stage: int, precision: str | None) -> None:
    spec = RunSpec(stage=stage, model=DROPOUT, micro_batch=2, grad_accum=2)
    uninterrupted = run_distributed(_train_save_train, 2, spec, precision, str(tmp_path))
    resumed = run_distributed(_load_train, 2, spec, precision, str(tmp_path))
    assert resumed[0]["losses"] == uninterrupted[0]
    assert resumed[0]["client"] == {"note": "ten steps", "step": 10}
    assert resumed[0]["path"] == str(tmp_path / "global_step10")
    assert read_latest(tmp_path).tag == "global_step10"
    # DeepSpeed's readers (its zero_to_fp32.py, its engine, scripts copied from them):
    tag = open(tmp_path / "latest").read().strip()  # noqa: SIM115 (their code, verbatim)
    assert (tmp_path / tag / "manifest.json").is_file()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["Lamb", "SGD"])
def test_resume_continues_bitwise_with_other_optimizers(
    tmp_path: Path, stage: int, optimizer: str
) -> None:
    # LAMB's param groups carry each rank's own parameter segments (its trust ratios are
    # per parameter): loading must keep this rank's, not take the saving rank 0's.
    params = {"lr": 1e-3, "weight_decay": 0.01}
    if optimizer == "SGD":
        params = {"lr": 0.05, "momentum": 0.9}
    spec = RunSpec(
        stage=stage,
        model=DROPOUT,
        micro_batch=2,
        grad_accum=2,
        optimizer=optimizer,
        opt_params=params,
    )
    uninterrupted = run_distributed(_train_save_train, 2, spec, None, str(tmp_path))
    resumed = run_distributed(_load_train, 2, spec, None, str(tmp_path))
    assert resumed[0]["losses"] == uninterrupted[0]


def test_resume_fp16_continues_bitwise_with_its_loss_scale(tmp_path: Path) -> None:
    spec = RunSpec(stage=2, model=DROPOUT, micro_batch=2, grad_accum=2)
    uninterrupted = run_distributed(_train_save_train, 2, spec, "fp16", str(tmp_path))
    resumed = run_distributed(_load_train, 2, spec, "fp16", str(tmp_path))
    assert resumed[0]["losses"] == uninterrupted[0]
    manifest = json.loads((tmp_path / "global_step10" / "manifest.json").read_text())
    assert manifest["loss_scaler"]["scale"] > 0
    assert manifest["compute_dtype"] == "fp16"


def _matches_checkpoint(engine, model, path: str) -> int:
    """Assert this rank's parameters and Adam moments equal the checkpoint's exactly;
    returns how many moment elements were compared."""
    reader = CheckpointReader.open(path)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), reader.tensor(name)), name
    names = regions.canonical_names(model)
    compared = 0
    for slot in regions.optimizer_slots(engine.checkpoint_state()):
        unit_names = regions.unit_names(slot.unit, names)
        state = engine.optimizer.state[slot.tensor]
        assert float(state["step"]) == reader.manifest.global_steps
        for key in ("exp_avg", "exp_avg_sq"):
            mine = state[key].reshape(-1)
            for s in regions.spans(slot.unit, unit_names, slot.start, slot.end):
                saved = torch.empty(s.hi - s.lo, dtype=mine.dtype)
                reader.read_into(f"optim.{key}", s.name, s.lo, saved)
                assert torch.equal(mine[s.at : s.at + s.hi - s.lo], saved), (key, s)
                compared += s.hi - s.lo
    return compared


def _reshard_source(spec: RunSpec, path: str) -> dict[str, Any]:
    model = make_model(spec)
    engine, *_ = zerotrain.initialize(model=model, config=zerotrain_config(spec, 4))
    train_steps(engine, spec, 0, 5)
    engine.save_checkpoint(path)
    compared = _matches_checkpoint(engine, model, str(Path(path) / "global_step5"))
    return {"losses": train_steps(engine, spec, 5, 10), "compared": compared}


def _reshard_target(spec: RunSpec, path: str) -> dict[str, Any]:
    torch.manual_seed(4321)
    model = zerotrain.examples.gpt.GPT(spec.model)  # different weights until loaded
    engine, *_ = zerotrain.initialize(
        model=model, config=zerotrain_config(spec, dist.get_world_size())
    )
    engine.load_checkpoint(path)
    compared = _matches_checkpoint(engine, model, str(Path(path) / "global_step5"))
    return {"losses": train_steps(engine, spec, 5, 10), "compared": compared}


def test_save_on_4_ranks_stage3_loads_on_2_ranks_stage1_and_1_rank_stage0(tmp_path: Path) -> None:
    source = RunSpec(stage=3, opt_params=PARITY_ADAM, micro_batch=2, grad_accum=1, steps=10)
    saved = run_distributed(_reshard_source, 4, source, str(tmp_path))
    assert all(r["compared"] > 0 for r in saved)
    numel = sum(p.numel() for p in make_model(source).parameters())
    assert sum(r["compared"] for r in saved) == 2 * numel  # each moment element once
    for world, stage in ((2, 1), (1, 0)):
        target = dataclasses.replace(source, stage=stage, grad_accum=4 // world)
        resumed = run_distributed(_reshard_target, world, target, str(tmp_path))
        assert resumed[0]["compared"] * (world if stage else 1) >= 2 * numel
        assert resumed[0]["losses"] == pytest.approx(saved[0]["losses"], abs=1e-5, rel=0)


def _save_then_die(spec: RunSpec, path: str) -> None:
    _, engine, loader = _build(spec, None)
    batches = _Batches(loader)
    _train(engine, batches, 2)
    engine.save_checkpoint(path, tag="good")
    _train(engine, batches, 2)
    original = StreamingWriter._emit
    written = [0]

    def emit_then_die(self: StreamingWriter, data: memoryview) -> None:
        original(self, data)
        written[0] += len(data)
        if written[0] > 20_000:  # about halfway through this rank's shard
            os.kill(os.getpid(), signal.SIGKILL)

    StreamingWriter._emit = emit_then_die  # type: ignore[method-assign]
    engine.save_checkpoint(path, tag="doomed")


def _resume_latest(spec: RunSpec, path: str) -> dict[str, Any]:
    _, engine, loader = _build(spec, None, seed_offset=3)
    loaded, _ = engine.load_checkpoint(path)
    losses = _train(engine, _Batches(loader), 1)
    engine.save_checkpoint(path, tag="after")
    return {"loaded": loaded, "steps": engine.global_steps, "losses": losses}


def test_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    spec = RunSpec(stage=3, micro_batch=2, grad_accum=1)
    with pytest.raises(DistributedTestError, match=r"(?i)signal|killed|exit"):
        run_distributed(_save_then_die, 2, spec, str(tmp_path))
    assert read_latest(tmp_path).tag == "good"
    assert not (tmp_path / "doomed").exists()
    partial = tmp_path / ".doomed.partial"
    assert partial.is_dir()
    assert not (partial / "manifest.json").exists()
    with pytest.raises(CheckpointNotFoundError, match="doomed does not exist"):
        CheckpointReader.open(tmp_path, "doomed")
    with pytest.raises(CheckpointNotFoundError, match="interrupted"):
        CheckpointReader.open(partial)
    good = load_state_dict_from_checkpoint(tmp_path)
    assert good.keys() == load_state_dict_from_checkpoint(tmp_path, "good").keys()
    resumed = run_distributed(_resume_latest, 2, spec, str(tmp_path))
    assert resumed[0]["loaded"] == str(tmp_path / "good")
    assert resumed[0]["steps"] == 3
    assert resumed[0]["losses"][0] == pytest.approx(resumed[0]["losses"][0])  # finite
    assert not partial.exists()  # the next save cleared the leftover
    assert read_latest(tmp_path).tag == "after"


def _save_three(spec: RunSpec, path: str) -> None:
    _, engine, loader = _build(spec, None)
    batches = _Batches(loader)
    for tag in ("a", "b", "c"):
        _train(engine, batches, 1)
        engine.save_checkpoint(path, tag=tag, keep_last=2)


def _load_expecting_error(spec: RunSpec, path: str, model_cfg, strict: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = zerotrain.examples.gpt.GPT(model_cfg)
    engine, *_ = zerotrain.initialize(
        model=model, config=_config(spec, dist.get_world_size(), None)
    )
    try:
        engine.load_checkpoint(path, strict=strict)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    report = engine.last_load_report
    return {"error": None, "missing": report.missing, "unexpected": report.unexpected}


def test_bad_checkpoints_are_reported_with_the_file(tmp_path: Path) -> None:
    spec = RunSpec(stage=2, micro_batch=2, grad_accum=1)
    run_distributed(_save_three, 2, spec, str(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["b", "c", "latest", "latest.sha256"]  # keep_last=2

    # A different model: shapes named.
    wider = dataclasses.replace(TINY, n_embd=48)
    got = run_distributed(_load_expecting_error, 2, spec, str(tmp_path), wider, True)
    assert {r["error"] for r in got} == {"IncompatibleCheckpointError"}
    assert "wte.weight: checkpoint [256, 32], model [256, 48]" in got[0]["message"]

    # Extra parameters: strict refuses, strict=False loads the rest and reports them.
    biased = dataclasses.replace(TINY, bias=True)
    got = run_distributed(_load_expecting_error, 2, spec, str(tmp_path), biased, True)
    assert got[0]["error"] == "IncompatibleCheckpointError"
    assert "strict=False" in got[0]["message"]
    got = run_distributed(_load_expecting_error, 2, spec, str(tmp_path), biased, False)
    assert got[0]["error"] is None
    assert got[0]["unexpected"] == []
    assert got[0]["missing"]
    assert all(n.endswith(".bias") for n in got[0]["missing"])
    # Untying a tied head: both start from the saved tensor.
    untied = dataclasses.replace(TINY, tie_weights=False)
    got = run_distributed(_load_expecting_error, 2, spec, str(tmp_path), untied, True)
    assert got[0] == {"error": None, "missing": [], "unexpected": []}

    # One flipped byte in a shard: every rank raises, naming the file.
    shard = tmp_path / "c" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    got = run_distributed(_load_expecting_error, 2, spec, str(tmp_path), TINY, True)
    assert got[1]["error"] == "CorruptCheckpointError"
    assert str(shard) in got[1]["message"]
    assert got[0]["error"] == "CheckpointError"
    assert "[1]" in got[0]["message"]
    with pytest.raises(CorruptCheckpointError, match=r"rank00001\.safetensors is corrupt"):
        load_state_dict_from_checkpoint(tmp_path)

    # Truncated, missing, no manifest, no such tag.
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptCheckpointError, match=r"rank00001\.safetensors is 100 bytes"):
        load_state_dict_from_checkpoint(tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"rank00001\.safetensors is missing"):
        load_state_dict_from_checkpoint(tmp_path)
    (tmp_path / "b" / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="not a complete zerotrain checkpoint"):
        load_state_dict_from_checkpoint(tmp_path, "b")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_state_dict_from_checkpoint(tmp_path, "zzz")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["version"] = 99
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="format version 99"):
        load_state_dict_from_checkpoint(tmp_path)


def _save_and_destroy(spec: RunSpec, path: str, precision: str | None) -> dict[str, Any]:
    model, engine, loader = _build(spec, precision)
    _train(engine, _Batches(loader), 3)
    with zerotrain.zero.GatheredParameters(model.parameters()):
        held = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine.save_checkpoint(path)
    engine.destroy()  # the model in its own dtypes, with the fp32 master values
    return {"full": {k: v.clone() for k, v in model.state_dict().items()}, "held": held}


@pytest.mark.parametrize("precision", [None, "bf16"], ids=["fp32", "bf16"])
def test_consolidate_equals_the_models_state_dict(tmp_path: Path, precision: str | None) -> None:
    from zerotrain.cli.main import main

    spec = RunSpec(stage=3, micro_batch=2, grad_accum=2)
    got = run_distributed(_save_and_destroy, 2, spec, str(tmp_path / "ckpt"), precision)[0]
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    loaded = safetensors.torch.load_file(out)
    assert loaded.keys() == got["full"].keys()  # tied lm_head.weight included
    for key, value in got["full"].items():
        assert loaded[key].dtype == value.dtype, key
        assert torch.equal(loaded[key], value), key
    model = zerotrain.examples.gpt.GPT(spec.model)
    model.load_state_dict(loaded)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out), "--dtype", "bf16"]) == 0
    loaded = safetensors.torch.load_file(out)
    for key, value in got["held"].items():
        assert torch.equal(loaded[key], value.to(torch.bfloat16)), key


def _batchnorm_job(directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_consolidate_keeps_integer_buffers(tmp_path: Path) -> None:
    # BatchNorm's num_batches_tracked is int64: consolidation raised KeyError('int64').
    from zerotrain.checkpoint.consolidate import load_state_dict_from_checkpoint

    state = run_distributed(_batchnorm_job, 2, str(tmp_path / "ckpt"))[0]
    loaded = load_state_dict_from_checkpoint(tmp_path / "ckpt")
    assert loaded["1.num_batches_tracked"].dtype == torch.int64
    assert int(loaded["1.num_batches_tracked"]) == 2
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
