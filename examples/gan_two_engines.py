"""A GAN with two engines, written the way DeepSpeed's DCGAN tutorial writes it, with only
the import changed (``import zerotrain as deepspeed``): the discriminator takes two
``backward()`` calls (real and fake) before its ``step()``, and forwards go through the
modules themselves (``netD(real)``), not the engines.

    zerotrain run -n 2 examples/gan_two_engines.py --deepspeed --deepspeed_config cfg.json

To stay small and download-free the "images" are points in the plane: the real ones lie on
a ring of eight Gaussians, and the generator learns to place its samples there (the script
prints the generated points' mean distance from the ring before and after training).
"""

# The tutorial's names (netD, model_engineD, errD_real, ...) are kept so the two scripts
# can be compared line by line.
# ruff: noqa: N806

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import zerotrain as deepspeed
from zerotrain.accelerator import get_accelerator

NZ = 8  # noise dimensions

DEFAULT_CONFIG = {
    "train_batch_size": 64,
    "optimizer": {"type": "Adam", "params": {"lr": 0.0005, "betas": [0.5, 0.999], "eps": 1e-8}},
    "steps_per_print": 1000,
}


def get_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="GAN with two engines")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.0005)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by launchers")
    return parser


def ring(samples: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (samples,), generator=gen) * (2 * math.pi / 8)
    centres = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1) * 2.0
    return centres + 0.05 * torch.randn(samples, 2, generator=gen)


def off_ring(points: torch.Tensor) -> float:
    """Mean distance of ``points`` from the ring of modes (radius 2)."""
    return float((points.float().norm(dim=1) - 2.0).abs().mean())


def generator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(NZ, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2),
        nn.Linear(64, 1), nn.Sigmoid(),
    )  # fmt: skip


def config_path(args: argparse.Namespace) -> None:
    """Without --deepspeed_config, write the default config to a file and use it (the
    tutorial passes a JSON file)."""
    if args.deepspeed_config:
        return
    handle, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(DEFAULT_CONFIG, f)
    args.deepspeed_config = path


def train(args: argparse.Namespace) -> None:
    deepspeed.init_distributed()
    config_path(args)
    torch.manual_seed(0)
    netG, netD = generator(), discriminator()
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG
    )
    device = get_accelerator().device_name(model_engineD.local_rank)
    dataset = TensorDataset(ring(args.samples, seed=1))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    dataloader = DataLoader(
        dataset, batch_size=model_engineD.train_micro_batch_size_per_gpu(), sampler=sampler
    )
    real_label, fake_label = 1.0, 0.0
    fixed_noise = torch.randn(512, NZ, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        before = off_ring(netG(fixed_noise).cpu())

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for data in dataloader:
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size, 1), real_label, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)

            noise = torch.randn(batch_size, NZ, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            model_engineD.step()

            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for the generator's cost
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
        if model_engineD.global_rank == 0:
            print(
                f"[{epoch + 1}/{args.epochs}] Loss_D: {(errD_real + errD_fake).item():.4f} "
                f"Loss_G: {errG.item():.4f}"
            )

    with torch.no_grad():
        after = off_ring(netG(fixed_noise).cpu())
    if model_engineD.global_rank == 0:
        print(f"generated points' distance from the ring: {before:.2f} before, {after:.2f} after")


if __name__ == "__main__":
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    train(parser.parse_args())
