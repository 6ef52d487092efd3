"""Reading DeepSpeed checkpoints (``checkpoint/deepspeed_import.py``) against DeepSpeed's own
consolidations of the same files, and the refusals: unsafe pickles, missing or extra rank
files, layouts zerotrain does not read, a stage-0 optimizer that does not fit the job's groups.
The fixtures were written by DeepSpeed 0.19.8 (``tests/helpers/deepspeed_fixtures.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.deepspeed_fixtures import DATA, UNIVERSAL
from zerotrain.checkpoint.deepspeed_import import (
    _loss_scaler,
    is_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from zerotrain.checkpoint.deepspeed_pickle import SavedDynamicLossScaler, load_deepspeed_file
from zerotrain.checkpoint.deepspeed_reader import ImportedReader
from zerotrain.checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from zerotrain.config.policies import LossScalePolicy
from zerotrain.precision.loss_scaler import LossScaler
from zerotrain.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURES = sorted(p.name for p in DATA.iterdir() if p.is_dir())
# The fixture model's param groups, as the loading job lists them (stage 0 needs them).
GROUPS = [
    ["embed.weight", "hidden.weight", "head.weight"],
    ["embed.bias", "norm.weight", "norm.bias", "hidden.bias", "head.bias"],
]


def _read(path: Path):
    return read_deepspeed_checkpoint(path, None, lambda: GROUPS)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_weights_equal_deepspeeds_own_fp32_consolidation(fixture: str) -> None:
    """zero_to_fp32's output (saved by the generator) equals ours, element for element, read
    both whole and through the loader's region reads."""
    imported = _read(DATA / fixture)
    reference = torch.load(DATA / fixture / "fp32_reference.pt")
    reader = ImportedReader(imported)
    assert set(imported.tensors) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(reader.tensor(name, torch.float32), value, rtol=0, atol=0)
        if imported.tensors[name].trainable:
            torch.testing.assert_close(imported.whole("master", name), value, rtol=0, atol=0)
    assert imported.global_steps == 3
    assert imported.scheduler == {"last_batch_iteration": 2}
    assert imported.optimizer_type == "Adam"


@pytest.mark.parametrize("fixture", ["stage0_fp32", "stage3_bf16", UNIVERSAL])
def test_zero_to_fp32_reads_deepspeed_checkpoints(fixture: str) -> None:
    """zerotrain's zero_to_fp32 on DeepSpeed's own checkpoints: DeepSpeed's result."""
    ours = get_fp32_state_dict_from_zero_checkpoint(DATA / fixture)
    reference = torch.load(DATA / fixture / "fp32_reference.pt")
    assert set(ours) == set(reference)  # ours in the module's order, DeepSpeed's by group
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fixture", "universal"),
    [
        ("stage1_bf16", UNIVERSAL),  # trained bitwise like stage 2
        ("stage2_bf16", UNIVERSAL),
        ("stage3_fp32", "universal_stage3_fp32"),
    ],
)
def test_moments_equal_deepspeeds_universal_consolidation(fixture: str, universal: str) -> None:
    """ds_to_universal (DeepSpeed's code) consolidated the moments of the stage-2 and stage-3
    runs. Ours, cut from the padded partitions, are the same."""
    ours, theirs = _read(DATA / fixture), _read(DATA / universal)
    for name, entry in ours.tensors.items():
        if entry.trainable:
            for kind in ("optim.exp_avg", "optim.exp_avg_sq"):
                torch.testing.assert_close(
                    ours.whole(kind, name), theirs.whole(kind, name), rtol=0, atol=0
                )
            assert ours.optimizer_scalars[name] == {"step": (3.0, torch.float32)}


def test_detection_tells_deepspeed_from_zerotrain(tmp_path: Path) -> None:
    assert is_deepspeed_checkpoint(DATA / "stage3_fp32", None)
    assert is_deepspeed_checkpoint(DATA / "stage3_fp32", "global_step3")
    assert is_deepspeed_checkpoint(DATA / "stage3_fp32" / "global_step3", None)
    assert is_deepspeed_checkpoint(DATA / UNIVERSAL, None)  # through latest_universal
    (tmp_path / "latest").write_text("t")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "manifest.json").write_text("{}")
    assert not is_deepspeed_checkpoint(tmp_path, None)
    assert not is_deepspeed_checkpoint(tmp_path / "missing", None)


class _Payload:
    """Would run code when unpickled by a full unpickler."""

    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_unsafe_pickles_are_refused_naming_the_type(tmp_path: Path, capsys) -> None:
    file = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "hook": _Payload()}, file)
    with pytest.raises(CorruptCheckpointError, match=r"of type print, .*weights_only=True"):
        load_deepspeed_file(file)
    assert "unpickled code ran" not in capsys.readouterr().out
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="not a readable DeepSpeed file"):
        load_deepspeed_file(file)


def _copy(fixture: str, tmp_path: Path) -> Path:
    shutil.copytree(DATA / fixture, tmp_path / fixture)
    return tmp_path / fixture


def test_missing_or_extra_rank_files_are_named(tmp_path: Path) -> None:
    root = _copy("stage2_fp32", tmp_path)
    (root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"saved by 2 .* rank\(s\) \[1\] are missing"):
        _read(root)
    root = _copy("stage3_fp32", tmp_path)
    extra = root / "global_step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy(root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", extra)
    with pytest.raises(CheckpointNotFoundError, match=r"\[2\] are extra"):
        _read(root)


def test_tensor_parallel_layouts_are_refused(tmp_path: Path) -> None:
    root = _copy("stage1_bf16", tmp_path)
    shutil.copy(
        root / "global_step3" / "mp_rank_00_model_states.pt",
        root / "global_step3" / "mp_rank_01_model_states.pt",
    )
    with pytest.raises(IncompatibleCheckpointError, match="ds_to_universal"):
        _read(root)


def test_stage0_optimizer_must_fit_the_jobs_groups() -> None:
    with pytest.raises(IncompatibleCheckpointError, match="group 1 holds 5 parameters"):
        read_deepspeed_checkpoint(DATA / "stage0_fp32", None, lambda: [GROUPS[0], GROUPS[1][:4]])
    swapped = [GROUPS[0][::-1], GROUPS[1]]
    with pytest.raises(IncompatibleCheckpointError, match="another order"):
        read_deepspeed_checkpoint(DATA / "stage0_fp32", None, lambda: swapped)


def test_dynamic_loss_scale_resumes_deepspeeds_cadence() -> None:
    """DeepSpeed doubles the scale at a clean step when the clean steps before it since the
    last overflow are a positive multiple of the window, as zerotrain does. Saved 6 clean
    steps after an overflow (cur_iter 10, last overflow at 3) with a window of 4, both
    double at the third step after the load (the one that follows 8 clean steps)."""
    saved = SavedDynamicLossScaler()
    saved.__setstate__(
        {
            "cur_scale": 1024.0,
            "dynamic": True,
            "cur_iter": 10,
            "last_overflow_iter": 3,
            "scale_window": 4,
            "cur_hysteresis": 2,
        }
    )
    state = _loss_scaler(saved)
    assert state == {"scale": 1024.0, "clean_steps": 6, "grace": 2}
    ours = LossScaler(LossScalePolicy(None, 65536.0, 4, 2, False, 1.0))
    ours.load_state_dict(state)
    scales = []
    for _ in range(3):
        ours.update(overflow=False)
        scales.append(ours.scale)
    assert scales == [1024.0, 1024.0, 2048.0]


def test_a_stage0_optimizer_wrapper_is_refused_unless_only_weights_are_wanted(
    tmp_path: Path,
) -> None:
    """DeepSpeed's fp16/bf16 optimizer without ZeRO saves its own wrapper's state, which
    zerotrain does not read: refused by name, not dropped; the weights still load alone."""
    root = _copy("stage0_fp32", tmp_path)
    file = root / "global_step3" / "mp_rank_00_model_states.pt"
    saved = torch.load(file, weights_only=True)
    saved["optimizer"] = {"cur_scale": 1024.0, "fp32_groups_flat": [torch.zeros(3)]}
    torch.save(saved, file)
    with pytest.raises(IncompatibleCheckpointError, match="load_optimizer_states=False"):
        _read(root)
    weights_only = read_deepspeed_checkpoint(root, None, None)
    assert weights_only.optimizer_type is None
    reference = torch.load(DATA / "stage0_fp32" / "fp32_reference.pt")
    torch.testing.assert_close(
        weights_only.whole("master", "head.weight"), reference["head.weight"]
    )
