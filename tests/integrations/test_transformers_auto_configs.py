"""The shared peer configs that carry ``"auto"`` values (written for transformers' and
accelerate's DeepSpeed integrations: LLaMA-Factory, FastChat, transformers' and accelerate's
own templates, DeepSpeedExamples' Hugging Face tensor-parallel example) train through
``ZeroTrainTrainer`` as written, on 2 ranks (the tensor-parallel one on the 4 its
``autotp_size`` needs), a tiny Llama each.

Where a config has ``optimizer`` and ``scheduler`` sections, the engine builds them with the
``"auto"`` values filled from ``TrainingArguments`` and the run's length, and the Trainer
logs the rates of that schedule, stepped once per optimizer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.dist.test_peer_configs import PEER_DIR  # noqa: E402
from zerotrain.config import ConfigError  # noqa: E402
from zerotrain.config.source import parse_json_text  # noqa: E402
from zerotrain.integrations.transformers import ZeroTrainTrainer  # noqa: E402
from zerotrain.optim.schedulers import WarmupDecayLR, WarmupLR  # noqa: E402
from zerotrain.testing.dist import run_distributed  # noqa: E402

STEPS, LR, WARMUP = 3, 2e-3, 2
TENSOR_PARALLEL = (
    "deepspeedai__DeepSpeedExamples__training__tensor_parallel__hf_integration__configs__"
    "ds_config.json"
)


def _auto_configs() -> list[str]:
    def has_auto(value: Any) -> bool:
        if isinstance(value, dict):
            return any(has_auto(v) for v in value.values())
        return value == "auto"

    found = []
    for path in sorted(PEER_DIR.glob("*.json")):
        try:
            raw = _read(path.name)
        except ConfigError:
            continue  # template placeholders: not JSON until filled in (test_peer_configs)
        if has_auto(raw):
            found.append(path.name)
    return found


def _read(name: str) -> dict[str, Any]:
    return parse_json_text((PEER_DIR / name).read_text(), name)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _train(name: str, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    raw = _read(name)
    for section in ("fp16", "bf16"):
        if raw.get(section, {}).get("enabled") is True:
            # accelerate's templates enable fp16 outright, to pair with accelerate's own
            # mixed-precision setting; the Trainer has no fp16 on a CPU, so it is left to
            # TrainingArguments here (refused when they disagree: the filled-config test).
            raw[section]["enabled"] = "auto"
    trainer = ZeroTrainTrainer(
        model=model, args=args, train_dataset=_Tokens(), zerotrain_config=raw
    )
    trainer.train()
    history = trainer.state.log_history
    return {
        "steps": trainer.state.global_step,
        "losses": [h["loss"] for h in history if "loss" in h],
        "lrs": [h["learning_rate"] for h in history if "learning_rate" in h],
    }


def _train_each(names: list[str], out: str) -> dict[str, dict[str, Any]]:
    return {name: _train(name, f"{out}/{i}") for i, name in enumerate(names)}


def _expected_lrs(raw: dict[str, Any]) -> list[float] | None:
    """The rate of each step under the config's own schedule with the filled values."""
    scheduler = raw.get("scheduler")
    if scheduler is None:
        return None
    params = {k: v for k, v in scheduler.get("params", {}).items() if v != "auto"}
    params |= {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": WARMUP}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    kind = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}[scheduler["type"]]
    if kind is WarmupDecayLR:
        params["total_num_steps"] = STEPS
    schedule = kind(optimizer, **params)
    # DeepSpeed's schedules count from last_batch_iteration -1: step k (from 0) runs at k - 1.
    return [schedule.lrs_at(step - 1)[0] for step in range(STEPS)]


def test_auto_configs_train_through_the_trainer(tmp_path: Path) -> None:
    names = [n for n in _auto_configs() if n != TENSOR_PARALLEL]
    assert len(names) >= 6  # the corpus's "auto" configs (7 with the tensor-parallel one)
    results = run_distributed(_train_each, 2, names, str(tmp_path), timeout=300)[0]
    if TENSOR_PARALLEL in _auto_configs():
        results |= run_distributed(_train_each, 4, [TENSOR_PARALLEL], str(tmp_path / "tp"))[0]
    for name, result in results.items():
        assert result["steps"] == STEPS, name
        assert all(torch.isfinite(torch.tensor(result["losses"]))), name
        expected = _expected_lrs(_read(name))
        if expected is not None:  # the engine's schedule, stepped once a step
            assert result["lrs"] == pytest.approx(expected, rel=1e-9), name
