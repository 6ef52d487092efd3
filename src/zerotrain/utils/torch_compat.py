"""Every private PyTorch API zerotrain relies on, in one place.

Each one is used because the public API has no equivalent (FSDP2 relies on the same ones);
keeping them here means a PyTorch release that moves one is mended in one file, and the
rest of the code reads as plain public API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = [
    "TreeSpec",
    "active_mode_counts",
    "fused_adam_kernel",
    "in_backward",
    "preserve_version_counter",
    "queue_end_of_backward",
    "storage_id",
    "storage_use_count",
    "tree_flatten",
    "tree_unflatten",
]


def in_backward() -> bool:
    """Whether autograd is running a node now (a forward called inside backward is an
    activation-checkpointing recomputation)."""
    return torch._C._current_autograd_node() is not None


def active_mode_counts() -> tuple[int, int]:
    """How many torch function modes and dispatch modes are active now."""
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass running now finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def storage_id(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage (also for meta tensors, which have no data
    pointer)."""
    return int(tensor.untyped_storage()._cdata)


@contextlib.contextmanager
def preserve_version_counter(tensor: torch.Tensor) -> Iterator[None]:
    """Writes to ``tensor`` inside are not seen by autograd's version check (refilling a
    buffer with the values that views saved for backward already held)."""
    with torch.autograd._unsafe_preserve_version_counter(tensor):
        yield


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors share ``tensor``'s storage (its reference count)."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def fused_adam_kernel(decoupled_weight_decay: bool) -> Callable[..., Any]:
    """torch's fused Adam (or AdamW) kernel over lists of tensors."""
    return torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
