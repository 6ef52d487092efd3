"""``set_random_seed``: seed every generator a training script draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA
    device), as ``deepspeed.runtime.utils.set_random_seed``: NumPy takes the seed modulo
    2**32 and torch modulo 2**63, the ranges they accept."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))
