"""Moving training states out of device memory between phases of a job, and back.

``engine.offload_states()`` / ``engine.reload_states()`` (DeepSpeed's names and enums): an
RLHF loop, say, frees the optimizer states, master weights and gradients of the model it
trains while another model generates, then brings them back for the next update.

Each state's tensors keep their identity (the optimizer, the parameters and ``.grad`` are
views of them): what moves is their *storage*. Offloading copies each storage's bytes into
host memory (pinned on request, where an accelerator exists) and resizes the storage to
zero, which frees the device memory; reloading resizes it back and copies the bytes in.
Stage 3 frees its gathered buffers the same way between uses (``shard/partitioned.py``).

Unlike DeepSpeed, the tensors keep reporting their device while offloaded, and reading one
before the reload reads freed memory (a segfault on the CPU, an illegal access on CUDA):
``engine/state_offload.py`` guards every engine entry point and re-points the parameters at
their host copy, but the optimizer's state tensors must not be read meanwhile. In return
the model and optimizer objects stay untouched, so nothing needs re-binding on reload.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


class OffloadStateTypeEnum(enum.StrEnum):
    """The states ``offload_states(include=...)`` names (DeepSpeed's enum and values)."""

    optim_states = "optim_states"  # the optimizer's state tensors (Adam's moments)
    hp_params = "hp_params"  # fp32 master weights (mixed precision)
    lp_params = "lp_params"  # the parameters the model computes with (stage 3: the shard)
    lp_grads = "lp_grads"  # accumulated gradients
    contiguous_grad_buffer = "contiguous_grad_buffer"  # staging buffers (freed, not copied)


class OffloadDeviceEnum(enum.StrEnum):
    """Where ``offload_states`` may move states (DeepSpeed's enum): only ``cpu`` moves
    anything; ``none`` does nothing (with a warning) and ``nvme`` is refused, as there."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


ALL_STATES = frozenset(OffloadStateTypeEnum)


def parse_include(include: Iterable[OffloadStateTypeEnum | str] | None) -> frozenset[str]:
    """The state names ``include`` selects (None: all), or a ValueError naming the allowed
    ones."""
    if include is None:
        return frozenset(s.value for s in ALL_STATES)
    if isinstance(include, str | OffloadStateTypeEnum):
        include = [include]
    allowed = sorted(s.value for s in ALL_STATES)
    chosen = set()
    for item in include:
        value = item.value if isinstance(item, OffloadStateTypeEnum) else item
        if value not in allowed:
            raise ValueError(
                f"offload_states(include=...): unknown state {item!r}; allowed: {allowed} "
                "(OffloadStateTypeEnum)"
            )
        chosen.add(value)
    return frozenset(chosen)


def parse_device(device: OffloadDeviceEnum | str | torch.device) -> OffloadDeviceEnum:
    """``device`` as the enum (a ``torch.device("cpu")`` is accepted too)."""
    if isinstance(device, torch.device):
        device = device.type
    value = device.value if isinstance(device, OffloadDeviceEnum) else str(device)
    try:
        return OffloadDeviceEnum(value)
    except ValueError:
        allowed = [d.value for d in OffloadDeviceEnum]
        raise ValueError(
            f"offload_states(device=...): unknown device {device!r}; allowed: {allowed}"
        ) from None


@dataclass
class _Moved:
    """One storage whose bytes are in host memory (``host`` None: freed, not kept)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None
    pinned: bool = False


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateMover:
    """Keeps the storages ``offload`` emptied, by state name, until ``reload``."""

    def __init__(self) -> None:
        self._moved: dict[str, list[_Moved]] = {}
        self._of_tensor: dict[int, _Moved] = {}  # id of each tensor offload was given

    @property
    def offloaded(self) -> frozenset[str]:
        """The state names whose storages are in host memory (or freed) now."""
        return frozenset(self._moved)

    def offload(
        self,
        states: Mapping[str, Sequence[torch.Tensor]],
        keep: Iterable[str],
        pin_memory: bool,
        non_blocking: bool,
    ) -> int:
        """Copy the storages of ``states`` to host memory and empty them; the names not in
        ``keep`` are emptied without a copy (their values are scratch). A storage shared by
        several tensors moves once, with the first state that names it. Returns the bytes
        freed."""
        keep = set(keep)
        by_ptr: dict[int, _Moved] = {}
        freed = 0
        for name, tensors in states.items():
            # Named even when it holds nothing yet (an optimizer before its first step):
            # the user asked for it to stay away, so the guards refuse what would create it.
            self._moved.setdefault(name, [])
            for tensor in tensors:
                storage = tensor.untyped_storage()
                nbytes = storage.nbytes()
                if nbytes == 0:
                    continue  # freed between uses (a stage-3 buffer), or moved already
                if not storage.resizable():
                    # Host memory that may not be resized: mapped or shared with other
                    # processes (the shared-memory transport's buffers), or read through
                    # ``.numpy()`` (the 1-bit exchange on a CPU), which torch then pins in
                    # place for NumPy's sake. It is host memory already: nothing to move.
                    continue
                moved = by_ptr.get(storage.data_ptr())
                if moved is None:
                    pin = pin_memory and storage.device.type != "cpu"
                    host = None
                    if name in keep:
                        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                        host.copy_(_bytes_of(storage), non_blocking=non_blocking and pin)
                    moved = by_ptr[storage.data_ptr()] = _Moved(storage, nbytes, host, pin)
                    self._moved.setdefault(name, []).append(moved)
                    freed += nbytes
                self._of_tensor[id(tensor)] = moved
        for moved in by_ptr.values():
            # The caching allocator orders the freed block's reuse after the copies queued
            # on this stream, so emptying need not wait for them.
            moved.storage.resize_(0)
        return freed

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor``'s values in host memory while offloaded (a tensor ``offload`` was
        given), to read and change in place; None if it was not moved or not kept."""
        moved = self._of_tensor.get(id(tensor))
        if moved is None or moved.host is None:
            return None
        start = tensor.storage_offset()
        flat = moved.host.view(tensor.dtype)[start : start + tensor.numel()]
        return flat.view(tensor.shape)

    def reload(self, non_blocking: bool) -> None:
        """Give every emptied storage its bytes back (scratch ones come back uninitialised)."""
        for moved in self._moved.values():
            for m in moved:
                m.storage.resize_(m.nbytes)
                if m.host is not None:
                    _bytes_of(m.storage).copy_(m.host, non_blocking=non_blocking and m.pinned)
        self._moved.clear()
        self._of_tensor.clear()
