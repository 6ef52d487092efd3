"""ZeroTrainTrainer against the transformers Trainer's own DDP run (2 ranks, CPU, gloo): a
tiny GPT-2, 20 micro-batches per rank with accumulation 3 over epochs of 10 (each epoch
ends with a window of one), linear schedule with warm-up, clipping. Losses equal DDP's within
1e-6 and final weights within 1e-5 at stages 0-3, the logged rates are the schedule's, and a stage-3
checkpoint of 2 ranks resumes on 1 rank (same global batch) exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from zerotrain.integrations.transformers import ZeroTrainTrainer  # noqa: E402
from zerotrain.testing.dist import run_distributed  # noqa: E402

SAMPLES, SEQ = 40, 16


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=gen)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _train(kind: str, out: str, per_device: int = 2, resume: str | None = None) -> dict:
    model = _model()
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=3,
        num_train_epochs=2,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if kind == "save" else "no",
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if kind == "ddp":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    else:
        stage = 3 if kind in ("save", "resume") else int(kind[-1])
        trainer = ZeroTrainTrainer(
            model=model,
            args=args,
            train_dataset=_Tokens(),
            zerotrain_config={"zero_optimization": {"stage": stage}},
        )
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "lrs": [h["learning_rate"] for h in history if "learning_rate" in h],
        "steps": [h["step"] for h in history if "loss" in h],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _all_kinds(out: str) -> dict[str, dict]:
    return {kind: _train(kind, f"{out}/{kind}") for kind in ("ddp", "s0", "s1", "s2", "s3")}


def test_trainer_stages_0_to_3_equal_the_trainers_ddp(tmp_path):
    results = run_distributed(_all_kinds, 2, str(tmp_path), timeout=600)[0]
    ddp = results["ddp"]
    assert len(ddp["losses"]) == 8  # 4 windows per epoch (3 + 3 + 3 + 1), 2 epochs
    for kind in ("s0", "s1", "s2", "s3"):
        got = results[kind]
        worst = max(abs(a - b) for a, b in zip(got["losses"], ddp["losses"], strict=True))
        assert worst <= 1e-6, (kind, got["losses"], ddp["losses"])
        assert got["lrs"] == ddp["lrs"], kind  # the rate each step used, as the Trainer logs
        # Weights to 1e-5: Adam turns a near-zero gradient element's rounding difference
        # (DDP's bucketed sum vs the engine's) into a sign, seen once at 1.6e-6.
        for name, value in ddp["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=0)


def _resume(out: str) -> dict:
    return _train("resume", f"{out}/resume", per_device=4, resume=f"{out}/save/checkpoint-4")


@pytest.mark.slow
def test_stage_3_checkpoint_of_2_ranks_resumes_on_1_rank(tmp_path):
    whole = run_distributed(_train, 2, "save", f"{tmp_path}/save", timeout=600)[0]
    assert (Path(tmp_path) / "save" / "checkpoint-4" / "zerotrain").is_dir()
    resumed = run_distributed(_resume, 1, str(tmp_path), timeout=600)[0]
    # The resumed history starts with the checkpoint's steps 1-4; compare the new ones.
    assert resumed["steps"] == whole["steps"]
    after = whole["steps"].index(5)
    new, old = resumed["losses"][after:], whole["losses"][after:]
    worst = max(abs(a - b) for a, b in zip(new, old, strict=True))
    assert worst <= 1e-6, (new, old)
    for name, value in whole["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-5, rtol=0)


def test_config_values_that_disagree_with_training_arguments_are_refused(tmp_path):
    from zerotrain.integrations.transformers import filled_config

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
        use_cpu=True, report_to=[],
    )  # fmt: skip
    assert filled_config({"train_batch_size": 6}, args)["gradient_accumulation_steps"] == 3
    with pytest.raises(ValueError, match=r"train_batch_size=8 disagrees .* = 6"):
        filled_config({"train_batch_size": 8}, args)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4 disagrees"):
        filled_config({"gradient_accumulation_steps": 4}, args)
    with pytest.raises(ValueError, match=r"optimizer.params.lr=0.1 disagrees .*5e-05"):
        filled_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, args)
    filled = filled_config({"optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, args)
    assert filled["optimizer"]["params"]["betas"] == [args.adam_beta1, args.adam_beta2]
