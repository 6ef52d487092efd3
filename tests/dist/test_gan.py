"""Two engines whose backward passes cross: a GAN trains exactly like plain PyTorch.

The generator's loss backpropagates through the discriminator, so the discriminator's
parameters receive gradients outside its own engine's backward. Plain PyTorch keeps them in
``.grad`` until the user clears them (``netD.zero_grad()``, ``optimizerD.zero_grad()``)
before the discriminator's next backward; an engine must do the same with its own buffers,
or the discriminator's next step trains on the generator's gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotrain
from zerotrain.testing.dist import run_distributed

NOISE, FEATURES, HIDDEN = 8, 12, 32
MICRO, STEPS, WORLD = 4, 6, 2
ADAM = {"lr": 1e-3, "betas": [0.5, 0.999], "eps": 1e-6}


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    gen = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, FEATURES))
    disc = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    return gen, disc


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    real = torch.randn(STEPS, world * MICRO, FEATURES, generator=g) * 0.5 + 1.0
    noise = torch.randn(STEPS, world * MICRO, NOISE, generator=g)
    return real, noise


def _losses(gen, disc, real, noise):
    """The three losses of one GAN iteration, in DCGAN's order (as callables, so each side
    runs its forward when asked)."""
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = gen(noise)
    d_real = disc(real)
    d_fake = disc(fake.detach())
    return fake, bce(d_real, torch.ones_like(d_real)), bce(d_fake, torch.zeros_like(d_fake))


def _gen_loss(disc, fake):
    out = disc(fake)
    return nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out))


def _reference(clear: str) -> list[tuple[float, float]]:
    gen, disc = _models()
    opt_g = torch.optim.Adam(gen.parameters(), **ADAM)
    opt_d = torch.optim.Adam(disc.parameters(), **ADAM)
    real, noise = _data(WORLD)
    out = []
    for step in range(STEPS):
        if clear == "module":
            disc.zero_grad()
        elif clear in ("optimizer", "engine"):
            opt_d.zero_grad()
        fake, err_real, err_fake = _losses(gen, disc, real[step], noise[step])
        err_d = err_real + err_fake
        err_d.backward()
        opt_d.step()
        gen.zero_grad()
        err_g = _gen_loss(disc, fake)
        err_g.backward()
        opt_g.step()
        out.append((err_d.item(), err_g.item()))
    return out


def _zerotrain(stage: int, clear: str, separate: bool = False) -> list[tuple[float, float]]:
    gen, disc = _models()
    rank = dist.get_rank()

    def config() -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "Adam", "params": {**ADAM, "adam_w_mode": False}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 1000,
        }

    engine_g, _, _, _ = zerotrain.initialize(model=gen, config=config())
    engine_d, opt_d, _, _ = zerotrain.initialize(model=disc, config=config())
    real, noise = _data(WORLD)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    out = []
    for step in range(STEPS):
        if clear == "module":
            disc.zero_grad()
        elif clear == "optimizer":
            opt_d.zero_grad()
        elif clear == "engine":
            engine_d.zero_grad()
        fake, err_real, err_fake = _losses(engine_g, engine_d, real[step, mine], noise[step, mine])
        err_d = err_real + err_fake
        if separate:  # DeepSpeed's DCGAN example: one backward per loss, then one step
            with engine_d.no_sync():
                engine_d.backward(err_real)
            engine_d.backward(err_fake)
        else:
            engine_d.backward(err_d)
        engine_d.step()
        gen.zero_grad()
        err_g = _gen_loss(engine_d, fake)
        engine_g.backward(err_g)
        engine_g.step()
        losses = engine_d.comm.all_reduce_floats([err_d.item(), err_g.item()])
        out.append((losses[0] / WORLD, losses[1] / WORLD))
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clear", ["module", "optimizer", "engine"])
def test_gan_trains_like_plain_pytorch(stage: int, clear: str) -> None:
    expected = _reference(clear)
    got = run_distributed(_zerotrain, WORLD, stage, clear)[0]
    for step, (ours, ref) in enumerate(zip(got, expected, strict=True)):
        assert ours == pytest.approx(ref, abs=1e-5), f"step {step}: {ours} vs {ref}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gan_with_one_backward_per_discriminator_loss(stage: int) -> None:
    expected = _reference("module")
    got = run_distributed(_zerotrain, WORLD, stage, "module", True)[0]
    for step, (ours, ref) in enumerate(zip(got, expected, strict=True)):
        assert ours == pytest.approx(ref, abs=1e-5), f"step {step}: {ours} vs {ref}"
