"""A CIFAR-10 classifier written the way DeepSpeed's CIFAR tutorial writes it, with only the
import changed (``import zerotrain as deepspeed``).

    zerotrain run -n 2 examples/cifar_deepspeed_style.py --stage 2 --epochs 3

No download: the images are synthetic, CIFAR-shaped (3 x 32 x 32, 10 classes), each class a
fixed random colour pattern under noise, so the accuracy printed at the end says whether the
network learned (chance is 10%). Pass ``--deepspeed_config file.json`` to use a config
file instead of the one built below from the flags.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import zerotrain as deepspeed
from zerotrain.accelerator import get_accelerator


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR-style training")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="synthetic training images")
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by launchers")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_cifar(samples: int, seed: int) -> TensorDataset:
    """Ten classes, each a fixed random image, seen through noise."""
    patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(samples, 3, 32, 32, generator=gen)
    return TensorDataset(images, labels)


class Net(nn.Module):
    """The tutorial's network."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def config(args: argparse.Namespace) -> dict:
    """The tutorial's config, stage and dtype from the flags."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 100},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


def main() -> None:
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=synthetic_cifar(args.samples, seed=1),
        config=None if args.deepspeed_config else config(args),
    )
    assert trainloader is not None
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if model_engine.global_rank == 0 and i % 50 == 49:
                print(f"[{epoch + 1}, {i + 1:4d}] loss: {running_loss / 50:.3f}")
                running_loss = 0.0

    correct = total = 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(synthetic_cifar(512, seed=2), 64):
            images = images.to(local_device)
            if target_dtype is not None:
                images = images.to(target_dtype)
            predicted = model_engine(images).argmax(dim=1).cpu()
            total += labels.size(0)
            correct += int((predicted == labels).sum())
    if model_engine.global_rank == 0:
        print(f"accuracy of the network on 512 held-out images: {100 * correct / total:.1f} %")


if __name__ == "__main__":
    main()
