"""Helpers for building and running pipeline layers: per-layer seeding, output checks."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def layer_seed(seed: int | None, seed_fn: Callable[[int], Any] | None) -> Iterator[None]:
    """Seed the random generators for one layer's construction, then restore them.

    Restoring keeps the caller's random stream independent of how many layers this rank
    built. Without ``seed_fn`` only torch's CPU generator is seeded (layers are initialised
    on the CPU before they move), plus the CUDA generators when CUDA is already initialised:
    ``torch.manual_seed`` would otherwise queue a seeding of CUDA at its initialisation that
    nothing could undo. ``seed`` None: no seeding.
    """
    if seed is None:
        yield
        return
    cpu, py = torch.get_rng_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        if seed_fn is not None:
            seed_fn(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
            if cuda is not None:
                torch.cuda.manual_seed_all(seed)
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def check_layer_output(out: Any, idx: int, name: str) -> Any:
    """``out`` if it is a tensor or a tuple/list of tensors (what a stage boundary can send).

    Raises:
        TypeError: anything else, naming the layer by global index and class.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and all(isinstance(t, torch.Tensor) for t in out):
        return out
    got = type(out).__name__
    if isinstance(out, tuple | list):
        got += f" of ({', '.join(type(t).__name__ for t in out)})"
    raise TypeError(
        f"pipeline layer {idx} ({name}) returned {got}; a layer must return a tensor or a "
        "non-empty tuple/list of tensors, which the next layer (or the next stage) receives "
        "as its one argument"
    )


def needs_grad(inputs: Any, params: Iterable[nn.Parameter]) -> bool:
    """Whether a checkpointed group would have anything to recompute for: gradients are on
    and some input tensor or parameter of the group requires one."""
    if not torch.is_grad_enabled():
        return False
    tensors = inputs if isinstance(inputs, tuple | list) else (inputs,)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        return True
    return any(p.requires_grad for p in params)
