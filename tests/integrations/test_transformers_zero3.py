"""transformers at ZeRO stage 3 as DeepSpeed users write it, 2 ranks, CPU:

* ``from_pretrained`` inside ``zerotrain.zero.Init``: the model comes out with no parameter
  memory (meta), ``initialize`` partitions the pretrained values, and a Trainer run from it
  (evaluating inside ``train``) equals one from a model loaded normally, step for step, and
  the Trainer's own DDP run within 1e-6, training and evaluation losses;
* ``generate()`` at stage 3 without ``synced_gpus``: ranks that stop at different lengths
  must keep running forward passes (each gathers with collectives) until every rank is done.
  transformers decides that from the signal the engine sets (it reads FSDP's attribute;
  DeepSpeed's own signal needs DeepSpeed installed); the tokens equal one process's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zerotrain  # noqa: E402
from zerotrain.integrations.transformers import ZeroTrainTrainer  # noqa: E402
from zerotrain.testing.dist import run_distributed  # noqa: E402

SEQ = 12
STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _save_pretrained(path: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 24) -> None:
        gen = torch.Generator().manual_seed(5 + count)
        self.ids = torch.randint(0, 64, (count, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _fine_tune(path: str, out: str, inside_init: bool, ddp: bool = False) -> dict[str, Any]:
    if inside_init:
        with zerotrain.zero.Init(config_dict_or_path=STAGE3):
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    devices = sorted({p.device.type for p in model.parameters()})
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=3e-3,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="steps",  # evaluation inside train(), through the engine
        eval_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    data = {"train_dataset": _Tokens(), "eval_dataset": _Tokens(8)}
    if ddp:
        trainer = transformers.Trainer(model=model, args=args, **data)
    else:
        trainer = ZeroTrainTrainer(model=model, args=args, zerotrain_config=STAGE3, **data)
    trainer.train()
    history = trainer.state.log_history
    return {
        "devices_after_load": devices,
        "losses": [h["loss"] for h in history if "loss" in h],
        "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def test_from_pretrained_inside_zero_init_trains_like_a_normal_load(tmp_path):
    _save_pretrained(str(tmp_path / "pretrained"))
    path = str(tmp_path / "pretrained")
    inside = run_distributed(_fine_tune, 2, path, str(tmp_path / "a"), True, timeout=600)
    normal = run_distributed(_fine_tune, 2, path, str(tmp_path / "b"), False, timeout=600)
    assert inside[0]["devices_after_load"] == ["meta"]  # nothing materialised by the load
    assert normal[0]["devices_after_load"] == ["cpu"]
    assert len(inside[0]["losses"]) == 4
    assert len(inside[0]["eval_losses"]) == 2
    for key in ("losses", "eval_losses"):
        assert inside[0][key] == normal[0][key], key
    for name, value in normal[0]["params"].items():
        assert torch.equal(inside[0]["params"][name], value), name
    # And both as the Trainer's own DDP run: training and evaluation losses.
    ddp = run_distributed(_fine_tune, 2, path, str(tmp_path / "c"), False, True, timeout=600)
    for key in ("losses", "eval_losses"):
        assert inside[0][key] == pytest.approx(ddp[0][key], abs=1e-6, rel=0), key


def _generate(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    prompt = torch.tensor([[1 + rank, 7, 9, 4]])
    wanted = 3 + 4 * rank  # the ranks stop after different numbers of tokens
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    expected = reference.generate(prompt, max_new_tokens=wanted, do_sample=False)
    with zerotrain.zero.Init(config_dict_or_path=STAGE3):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = zerotrain.initialize(
        model=model, config={**STAGE3, "train_micro_batch_size_per_gpu": 1}
    )
    model.eval()
    marked = getattr(model, "_is_fsdp_managed_module", False)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=wanted, do_sample=False)  # no synced_gpus
    engine.destroy()
    return {
        "same": torch.equal(got, expected),
        "new_tokens": got.shape[1] - prompt.shape[1],
        "marked": marked,
        "unmarked_after_destroy": not hasattr(model, "_is_fsdp_managed_module"),
    }


def test_generate_at_stage_3_keeps_ranks_in_step_without_synced_gpus(tmp_path):
    _save_pretrained(str(tmp_path / "pretrained"))
    results = run_distributed(_generate, 2, str(tmp_path / "pretrained"), timeout=300)
    assert [r["new_tokens"] for r in results] == [3, 7]
    for r in results:
        assert r["same"], r
        assert r["marked"], r
        assert r["unmarked_after_destroy"], r
