"""Where a checkpointed region's inputs wait for its recomputation.

A checkpoint keeps only its inputs; ``torch.utils.checkpoint`` saves them through autograd's
saved-tensor hooks, and the hooks installed here (around the call, so they see exactly those
inputs) decide where they live: where they are (default), in host memory while the device
is an accelerator (``cpu_checkpointing``), and/or in one contiguous buffer reused every step
(``contiguous_memory_optimization``), which keeps long-lived inputs from fragmenting the
device allocator between the short-lived activations around them.

``partition_activations``: under tensor parallelism the inputs of a checkpointed block are
the same on every rank of the tensor group, so each rank keeps only its 1/t of each (a
slice of the flattened tensor, padded to a multiple of t) and the group all-gathers the
whole when the recomputation needs it: (t-1)/t of the kept bytes saved, for one all-gather
per input in backward (DeepSpeed's ``partition_activations`` with a model-parallel group).
The slice itself is then kept by the other settings (host memory, the buffer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerotrain.checkpointing.stats import CheckpointStats
from zerotrain.comm.collectives import Communicator
from zerotrain.utils.logging import get_logger
from zerotrain.utils.torch_compat import storage_use_count

log = get_logger(__name__)

_ALIGN = 512  # bytes: every placed tensor starts on a boundary any kernel is happy with


def _copy_strides(like: torch.Tensor) -> tuple[int, ...]:
    """The strides a copy of ``like`` gets: its own when it is dense (recomputation then
    runs the same kernels on it), else contiguous."""
    return torch.empty_like(like, device="meta").stride()


def _storage_refs(buffer: torch.Tensor) -> int:
    return storage_use_count(buffer)


class ContiguousArena:
    """One byte buffer that checkpoint inputs are copied into, front to back.

    The buffer is rewound when nothing but the arena references it any more (every input
    placed in it has been used by its recomputation and dropped), so each step reuses the
    same memory. A step that needs more than the buffer holds gets separate allocations for
    the overflow, and the buffer is reallocated at the size the step needed once it is free.

    Args:
        device: where the buffer lives.
        pin: page-locked host memory (for asynchronous copies to an accelerator).
        initial_bytes: first size (0: sized by the first step).
    """

    def __init__(self, device: torch.device, pin: bool, initial_bytes: int = 0) -> None:
        self.device = device
        self.pin = pin
        self.capacity = initial_bytes
        self.buffer: torch.Tensor | None = None
        self._idle_refs = 0
        self.cursor = 0
        self.wanted = 0  # bytes asked for since the last rewind, overflow included
        self._overflow: list[weakref.ref[torch.Tensor]] = []  # placed outside the buffer

    def _in_use(self) -> bool:
        if self.buffer is not None and _storage_refs(self.buffer) > self._idle_refs:
            return True
        return any(ref() is not None for ref in self._overflow)

    def _rewind_if_free(self) -> None:
        if self._in_use():
            return
        if self.wanted > self.capacity:
            log.debug(
                "checkpoint buffer on %s: %d -> %d bytes", self.device, self.capacity, self.wanted
            )
            self.capacity = self.wanted
            self.buffer = None
        if self.buffer is None and self.capacity:
            self.buffer = torch.empty(
                self.capacity, dtype=torch.uint8, device=self.device, pin_memory=self.pin
            )
            self._idle_refs = _storage_refs(self.buffer)
        self.cursor = 0
        self.wanted = 0
        self._overflow.clear()

    def place(self, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor with ``like``'s shape, dtype and (if dense) strides, in the
        buffer when it fits, else allocated on its own."""
        self._rewind_if_free()
        nbytes = like.numel() * like.element_size()
        start = -(-self.cursor // _ALIGN) * _ALIGN
        self.wanted = -(-self.wanted // _ALIGN) * _ALIGN + nbytes
        if self.buffer is None or start + nbytes > self.capacity:
            tensor = _empty_like(like, self.device, self.pin)
            self._overflow.append(weakref.ref(tensor))
            return tensor
        self.cursor = start + nbytes
        flat = self.buffer[start : start + nbytes].view(like.dtype)
        return flat.as_strided(like.shape, _copy_strides(like))


def _empty_like(like: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.empty_strided(
        like.shape, _copy_strides(like), dtype=like.dtype, device=device, pin_memory=pin
    )


@dataclass
class _OnHost:
    """An input copied to host memory; ``ready`` marks the end of the copy."""

    host: torch.Tensor
    device: torch.device
    ready: Any  # torch.cuda.Event (accelerators only)


@dataclass
class _Partitioned:
    """This rank's slice of an input that every rank of ``group`` holds alike."""

    kept: Any  # the slice, as the other settings keep it
    shape: torch.Size
    numel: int
    group: Communicator


class InputKeeper:
    """The pack/unpack pair for checkpoint inputs under one setting.

    Args:
        to_host: move inputs on an accelerator to host memory.
        contiguous: copy inputs into a reused buffer (one per device; in pinned host memory
            for inputs moved there).
        number_checkpoints: checkpoints per step, to size each buffer from its first input
            (None: the first step's needs size it).
        stats: counters to feed.
        partition: the tensor group to split inputs over (None: keep them whole).
    """

    def __init__(
        self,
        to_host: bool,
        contiguous: bool,
        number_checkpoints: int | None,
        stats: CheckpointStats,
        partition: Communicator | None = None,
    ) -> None:
        self.to_host = to_host
        self.contiguous = contiguous
        self.partition = partition
        self.number_checkpoints = number_checkpoints
        self.stats = stats
        self._arenas: dict[tuple[torch.device, bool], ContiguousArena] = {}
        self._streams: dict[torch.device, Any] = {}

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter):
            self.stats.kept_bytes += tensor.numel() * tensor.element_size()
            return tensor  # alive anyway: a copy would only add memory
        group = self.partition
        if group is not None and tensor.is_floating_point() and tensor.numel() >= group.world_size:
            return self._partition(tensor, group)
        return self._keep(tensor)

    def _partition(self, tensor: torch.Tensor, group: Communicator) -> _Partitioned:
        per_rank = -(-tensor.numel() // group.world_size)
        flat = tensor.detach().reshape(-1)
        start = min(group.rank * per_rank, flat.numel())
        mine = torch.zeros(per_rank, dtype=tensor.dtype, device=tensor.device)
        piece = flat[start : start + per_rank]
        mine[: piece.numel()].copy_(piece)
        self.stats.partitioned_bytes += (tensor.numel() - per_rank) * tensor.element_size()
        return _Partitioned(self._keep(mine), tensor.shape, tensor.numel(), group)

    def _keep(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.kept_bytes += nbytes
        if self.to_host and tensor.device.type != "cpu":
            self.stats.offloaded_bytes += nbytes
            return self._to_host(tensor)
        if self.contiguous:
            with torch.no_grad():
                return self._place(tensor, tensor.device, pin=False).copy_(tensor)
        return tensor

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Partitioned):
            mine = self.unpack(packed.kept)
            whole = torch.empty(
                (packed.group.world_size, mine.numel()), dtype=mine.dtype, device=mine.device
            )
            packed.group.all_gather_into(whole, mine, purpose="activations")
            return whole.reshape(-1)[: packed.numel].view(packed.shape)
        if not isinstance(packed, _OnHost):
            return packed
        torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        return packed.host.to(packed.device, non_blocking=True)

    def _place(self, like: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        if not self.contiguous:
            return _empty_like(like, device, pin)
        arena = self._arenas.get((device, pin))
        if arena is None:
            first = -(-like.numel() * like.element_size() // _ALIGN) * _ALIGN
            arena = ContiguousArena(device, pin, first * (self.number_checkpoints or 0))
            self._arenas[(device, pin)] = arena
        return arena.place(like)

    def _to_host(self, tensor: torch.Tensor) -> _OnHost:
        host = self._place(tensor, torch.device("cpu"), pin=True)
        # The copy runs on a side stream, after whatever produced the tensor, so the next
        # layer's compute goes on meanwhile; record_stream keeps the allocator from reusing
        # the device memory before the copy has read it.
        copier = self._streams.get(tensor.device)
        if copier is None:
            copier = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        copier.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(copier), torch.no_grad():
            host.copy_(tensor, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(copier)
        tensor.record_stream(copier)
        return _OnHost(host, tensor.device, ready)
