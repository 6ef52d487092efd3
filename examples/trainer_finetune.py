"""Fine-tune a causal language model with the transformers Trainer on zerotrain (no DeepSpeed).

    zerotrain run -n 2 examples/trainer_finetune.py --stage 3 --max-steps 20

Offline and small: the model is a 2-layer GPT-2 built from a config (swap in
``AutoModelForCausalLM.from_pretrained(name)`` for a real one), the text is this repository's
demo corpus, cut into 64-byte windows (byte-level: vocabulary 256). The only change from a
plain Trainer script is ``ZeroTrainTrainer`` with a ``zerotrain_config``.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from zerotrain.examples.corpus import load_corpus
from zerotrain.integrations.transformers import ZeroTrainTrainer

SEQ = 64


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of the corpus as token ids (bytes); labels = inputs."""

    def __init__(self, limit: int) -> None:
        data = torch.frombuffer(bytearray(load_corpus()[: limit * SEQ]), dtype=torch.uint8)
        self.windows = data.long().view(-1, SEQ)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="trainer_out")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4
    )
    model = transformers.GPT2LMHeadModel(config)
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = ZeroTrainTrainer(
        model=model,
        args=training_args,
        train_dataset=ByteWindows(limit=2048),
        zerotrain_config={"zero_optimization": {"stage": args.stage}},
    )
    result = trainer.train()
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(
            f"trainer_finetune: {result.global_step} steps, train loss {result.training_loss:.4f}"
        )


if __name__ == "__main__":
    main()
