"""Per-rank memory accounting of model states, by category."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from zerotrain.utils.memory import format_bytes
from zerotrain.zero.strategy import ZeroStrategy


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes this rank holds for the model's states.

    Attributes:
        params: parameters in their compute dtype (the whole model at stages 0-2).
        grads: gradient buffers.
        master_weights: fp32 copies kept for the optimizer (mixed precision only).
        optimizer_states: optimizer state tensors (moments, momentum buffers).
        buffers: module buffers (e.g. normalisation statistics).
        gathered: the gathered working set (stage 3): the most bytes of whole unit buffers
            held at once so far, persistent units included.
        staging: buffers gradients pass through on their way to a reduce-scatter (stages
            2-3; sized by the largest unit, not by the model).
        offload_buffers: host buffers the offloaded optimizer step streams chunks through.
        nvme: bytes in this rank's swap files (NVMe offload); not memory, so not in
            ``total``.
        device: the training device type; ``host``: the categories kept in host memory
            there (offloaded master weights and optimizer states on a GPU run).
    """

    params: int
    grads: int
    master_weights: int
    optimizer_states: int
    buffers: int
    gathered: int = 0
    staging: int = 0
    offload_buffers: int = 0
    nvme: int = 0
    device: str = "cpu"
    host: tuple[str, ...] = ()

    def _categories(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k not in ("nvme", "device", "host")}

    @property
    def total(self) -> int:
        """Bytes in memory: every category but ``nvme``."""
        return sum(self._categories().values())

    def by_device(self) -> dict[str, int]:
        """Bytes resident on the training device, in host memory, and on NVMe."""
        placed = dict.fromkeys((self.device, "cpu", "nvme"), 0)
        for name, value in self._categories().items():
            where = "cpu" if name in self.host or name == "offload_buffers" else self.device
            placed[where] += value
        placed["nvme"] = self.nvme
        return placed

    def as_dict(self) -> dict[str, int]:
        """Categories (``total`` and ``nvme`` included) as a plain dict."""
        return {**self._categories(), "total": self.total, "nvme": self.nvme}

    def __str__(self) -> str:
        text = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.as_dict().items())
        if self.device != "cpu" and self.host:
            places = self.by_device()
            text += "; " + ", ".join(f"{k} {format_bytes(v)}" for k, v in places.items())
        return text


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total storage bytes of ``tensors`` (each counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in ``optimizer.state``, and of the buffers an optimizer keeps
    beside it (``state_tensors()``: the 1-bit optimizers' whole momentum and error
    feedback), each storage counted once (their per-piece states are views of it)."""
    if optimizer is None:
        return 0
    tensors = [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    extra = getattr(optimizer, "state_tensors", None)
    if extra is not None:
        tensors += list(extra())
    storages: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def buffer_bytes(module: nn.Module) -> int:
    """Bytes of the module's registered buffers."""
    return tensor_bytes(module.buffers())


def memory_breakdown(
    module: nn.Module, strategy: ZeroStrategy, optimizer: torch.optim.Optimizer | None
) -> MemoryBreakdown:
    """Bytes this rank holds for the model states of ``module`` trained by ``strategy``."""
    managed = strategy.managed()
    loose = [p for p in module.parameters() if id(p) not in managed]
    offload = strategy.offload
    device = strategy.comm.device.type
    host: tuple[str, ...] = ()
    if offload is not None and offload.policy.optimizer != "none":
        host = ("master_weights", "optimizer_states")
    return MemoryBreakdown(
        params=strategy.param_bytes() + tensor_bytes(loose),
        grads=strategy.grad_bytes(),
        master_weights=strategy.master_bytes(),
        optimizer_states=optimizer_state_bytes(optimizer),
        buffers=buffer_bytes(module),
        gathered=strategy.gathered_bytes()[1],
        staging=strategy.staging_bytes(),
        offload_buffers=offload.buffer_bytes() if offload is not None else 0,
        nvme=offload.nvme_bytes() if offload is not None else 0,
        device=device,
        host=host,
    )
