"""Capture and restore every random number generator a training step may draw from: Python's
``random``, NumPy's global generator, torch's CPU generator and the current CUDA device's.

Python and NumPy states go into the manifest as JSON; torch's are byte tensors stored in the
rank's shard file.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

TORCH_KEY = "rng.torch"
CUDA_KEY = "rng.cuda"


def capture(device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's generator states: ``(json_part, tensors)``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }
    tensors = {TORCH_KEY: torch.get_rng_state()}
    if device.type == "cuda":
        tensors[CUDA_KEY] = torch.cuda.get_rng_state(device)
    return state, tensors


def restore(state: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what :func:`capture` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors[TORCH_KEY])
    if device.type == "cuda" and CUDA_KEY in tensors:
        torch.cuda.set_rng_state(tensors[CUDA_KEY], device)
