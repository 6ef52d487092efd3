"""Random streams for tensor parallelism: shared outside the split regions, per rank inside.

Outside tensor-parallel regions every rank of the tensor group holds the same tensors, so a
dropout there must draw the same mask on every rank (or the replicas drift apart): the
default generator, seeded alike on the group, serves it. Inside a region each rank holds a
different slice (its heads, its MLP columns), and the slices' masks must be independent, as
they would be in the dense model: :meth:`TensorParallelRNG.fork` switches the default
generator to a stream of this rank's own (seeded ``seed + 2718 + rank``, Megatron's
offset) for the length of the region, and back, so draws inside do not move the shared
stream.

Activation checkpointing replays the default generator's state at the start of a
checkpointed region; a region that forks inside must be recomputed with the fork's state
as it was then too, or the recomputation draws new masks. The stream registers itself with
``zerotrain.checkpointing.streams``, which records it as each region's forward starts and
sets it back around the recomputation (a region nested in another checkpointed region is
not replayed this way: do not nest checkpointed regions around forked dropout).

Model code marks a region with ``with tensor_parallel_rng(self):`` (a no-op on a model that
is not split); the engine attaches the stream to the model's modules when it splits them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from zerotrain.checkpointing.streams import register_random_stream
from zerotrain.comm.collectives import Communicator

MEGATRON_OFFSET = 2718


class TensorParallelRNG:
    """This rank's own random stream for tensor-parallel regions.

    Args:
        comm: the tensor group (the stream is seeded from the rank in it).
        seed: the job's seed (the same on every rank).
    """

    def __init__(self, comm: Communicator, seed: int) -> None:
        self.device = comm.device
        # A private generator of the device's kind makes the first state: torch.manual_seed
        # would reseed every generator, the CPU's included, so on a GPU each tensor rank's
        # CPU stream (a collator's masking, an unseeded shuffle) would differ across a group
        # that must see the same inputs.
        own = torch.Generator(device=self.device)
        own.manual_seed(seed + MEGATRON_OFFSET + comm.rank)
        self._state = own.get_state()
        register_random_stream(self)

    def get_state(self) -> torch.Tensor:
        """The stream's state (what the next fork starts from)."""
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        """Continue the stream from ``state``."""
        self._state = state.clone()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this rank's stream inside the block; the shared stream is left where
        it was."""
        shared = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(shared)


_ATTACHED: weakref.WeakKeyDictionary[nn.Module, TensorParallelRNG] = weakref.WeakKeyDictionary()


def attach_rng(model: nn.Module, rng: TensorParallelRNG) -> None:
    """Let every module of ``model`` find ``rng`` through :func:`tensor_parallel_rng`."""
    for module in model.modules():
        _ATTACHED[module] = rng


def tensor_parallel_rng(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Inside a split region of ``module`` (dropout on this rank's heads): draw from this
    rank's own stream when the model is tensor-parallel, else from the default generator."""
    rng = _ATTACHED.get(module)
    return rng.fork() if rng is not None else contextlib.nullcontext()
