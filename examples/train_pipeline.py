"""The demo GPT trained as a 2-stage pipeline with ZeRO inside each stage.

zerotrain run -n 2 examples/train_pipeline.py        # 2 stages
zerotrain run -n 4 examples/train_pipeline.py        # 2 stages x 2 data-parallel replicas

The model is a list of layers (token embedding, blocks, final norm, output head tied to the
embedding); each rank builds only its stage's layers. ``train_batch`` runs
``gradient_accumulation_steps`` micro-batches through the stages with the 1F1B schedule
and steps the optimizer; see docs/pipeline.md.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import zerotrain
from zerotrain.examples.corpus import load_corpus
from zerotrain.examples.gpt import GPTConfig, gpt_loss_fn, gpt_pipeline_layers
from zerotrain.pipe import PipelineModule

STAGES = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,  # micro-batches per train_batch (>= stages for 1F1B)
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2},
    "pipeline": {"schedule": "1f1b", "grad_reduce": "end_of_step"},
    "steps_per_print": 10,
}


def windows(cfg: GPTConfig, count: int) -> TensorDataset:
    """``count`` random (input, next-token) windows of the demo corpus."""
    data = torch.frombuffer(bytearray(load_corpus()[:500_000]), dtype=torch.uint8).long()
    starts = torch.randint(0, len(data) - cfg.block_size - 1, (count,))
    tokens = data[starts[:, None] + torch.arange(cfg.block_size + 1)]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=64)
    env = zerotrain.init_distributed()  # before the model: each rank builds only its stage
    if env.world_size % STAGES:
        raise SystemExit(f"run with a multiple of {STAGES} processes (got {env.world_size})")
    model = PipelineModule(
        gpt_pipeline_layers(cfg), num_stages=STAGES, loss_fn=gpt_loss_fn, seed_layers=True
    )
    engine, _, _, _ = zerotrain.initialize(
        model=model, training_data=windows(cfg, 4096), config=CONFIG
    )
    for _ in range(40):
        loss = engine.train_batch()  # reads the training data given to initialize
    if env.rank == 0:
        print(f"done: {engine.global_steps} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
