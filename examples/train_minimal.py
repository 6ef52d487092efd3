"""A plain PyTorch regression loop moved to zerotrain: the smallest complete example.

zerotrain run -n 2 examples/train_minimal.py        # 2 local processes
python examples/train_minimal.py                    # 1 process, same code
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

import zerotrain

CONFIG = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "steps_per_print": 20,
}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(2048, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    engine, _, loader, _ = zerotrain.initialize(
        model=model, training_data=TensorDataset(x, y), config=CONFIG
    )
    assert loader is not None
    for _epoch in range(5):
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(engine(xb), yb)
            engine.backward(loss)
            engine.step()
    if engine.comm.rank == 0:
        print(f"done: {engine.global_steps} optimizer steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
