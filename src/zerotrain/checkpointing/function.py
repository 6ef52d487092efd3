"""``checkpoint(fn, *args, **kwargs)``: keep a region's inputs, recompute the rest in backward.

Built on PyTorch's non-reentrant ``torch.utils.checkpoint`` (which replays the CPU and device
RNG states, so dropout draws the same masks, restores autocast, accepts non-tensor and
``requires_grad=False`` inputs and gives gradients to parameters even when no input needs
one). What this layer adds is the config: where the kept inputs live (``saved_inputs.py``),
synchronization at the region's boundaries, timing, and counting.

Under ZeRO stage 3 the region's modules are called again during recomputation, so their
forward hooks gather their units again; ``zero/gather.py`` keeps a unit gathered when its
forward runs inside backward, because that unit's backward follows at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint

from zerotrain.checkpointing.state import CheckpointingContext, active_context
from zerotrain.checkpointing.streams import RandomStream, record_streams, replayed
from zerotrain.utils.device import synchronize
from zerotrain.utils.torch_compat import TreeSpec, in_backward, tree_flatten, tree_unflatten

T = TypeVar("T")


def _device_of(values: list[Any]) -> torch.device | None:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), None)


class _Rebuild:
    """Calls ``fn`` with the original arguments from their flattened form, so every tensor
    nested in args and kwargs is a checkpoint input (kept, moved, and its device's RNG
    state recorded) and no keyword can collide with ``torch.utils.checkpoint``'s own."""

    def __init__(self, fn: Callable[..., Any], spec: TreeSpec) -> None:
        self.fn = fn
        self.spec = spec

    def __call__(self, *flat: Any) -> Any:
        args, kwargs = tree_unflatten(list(flat), self.spec)
        return self.fn(*args, **kwargs)


@contextlib.contextmanager
def _recomputation(
    context: CheckpointingContext,
    device: torch.device | None,
    timed: bool,
    sync: bool,
    streams: list[tuple[RandomStream, Any]],
) -> Iterator[None]:
    """Runs around each recomputation (which may end early by an exception of PyTorch's:
    once it has what backward needs it stops), with registered random streams replayed."""
    if sync or timed:
        synchronize(device)
    start = time.perf_counter()
    try:
        with replayed(streams):
            yield
    finally:
        if sync or timed:
            synchronize(device)
        context.stats.recomputes += 1
        if timed:
            context.stats.recompute_seconds += time.perf_counter() - start


def checkpoint(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs for backward; the activations
    inside are recomputed when backward reaches them.

    The CPU and device RNG states are recorded and replayed, so dropout inside ``fn``
    recomputes the same values and the gradients equal those without checkpointing.
    Arguments may be anything (tensors that need no gradient, None, numbers, nested
    structures); every tensor among them is kept. ``fn`` must be deterministic given its
    inputs and RNG state, and must not change its inputs in place. Without gradients
    (``torch.no_grad``, evaluation) ``fn`` simply runs.

    How the inputs are kept follows the active settings: the running engine's (from its
    config's ``activation_checkpointing`` section), else ``zerotrain.checkpointing.configure``.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    flat, spec = tree_flatten((args, kwargs))
    run = _Rebuild(fn, spec)
    context = active_context()
    if context.depth or in_backward():
        # Nested in a checkpointed region (its forward, or its recomputation in backward):
        # PyTorch's plain nesting, the same both times, which the outer region's count of
        # saved tensors relies on.
        return torch.utils.checkpoint.checkpoint(run, *flat, use_reentrant=False)
    policy = context.policy
    device = _device_of(flat)
    timed, sync = policy.profile, policy.synchronize

    def contexts() -> tuple[
        contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
    ]:
        # Called as the region's forward starts: the streams' states now are the ones the
        # recomputation must start from.
        streams = record_streams()
        return contextlib.nullcontext(), _recomputation(context, device, timed, sync, streams)

    keeper = context.keeper()
    if sync or timed:
        synchronize(device)
    start = time.perf_counter()
    context.depth += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(keeper.pack, keeper.unpack):
            out = torch.utils.checkpoint.checkpoint(
                run, *flat, use_reentrant=False, context_fn=contexts
            )
    finally:
        context.depth -= 1
    if sync or timed:
        synchronize(device)
    context.stats.calls += 1
    if timed:
        context.stats.forward_seconds += time.perf_counter() - start
    return out
