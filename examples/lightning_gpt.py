"""A byte-level GPT trained by PyTorch Lightning with zerotrain's ZeRO strategy.

python examples/lightning_gpt.py                      # 2 CPU processes, ZeRO stage 3
python examples/lightning_gpt.py --stage 2 --devices 1 --max-steps 50

Lightning launches the processes; zerotrain shards, reduces, clips and steps. Needs
``pip install zerotrain[lightning]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

from zerotrain.examples.corpus import ByteWindows, load_corpus
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.integrations.lightning import ZeroTrainStrategy


class LitGPT(pl.LightningModule):
    """The demo GPT with a training step and an optimizer: all Lightning needs."""

    def __init__(self, cfg: GPTConfig, lr: float) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    data = ByteWindows(load_corpus(), cfg.block_size)
    loader = DataLoader(Subset(data, range(2048)), batch_size=8, shuffle=True)
    trainer = pl.Trainer(
        strategy=ZeroTrainStrategy(stage=args.stage),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LitGPT(cfg, args.lr), loader)
    if trainer.is_global_zero:
        loss = trainer.callback_metrics["loss"]
        print(f"lightning_gpt: done, {trainer.global_step} steps, last loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
