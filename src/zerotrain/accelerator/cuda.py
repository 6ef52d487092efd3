"""The CUDA accelerator: DeepSpeed's ``CUDA_Accelerator`` answers, through ``torch.cuda``."""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from zerotrain.accelerator.base import Accelerator, DeviceIndex


def _index(device_index: DeviceIndex) -> int:
    return torch.cuda.current_device() if device_index is None else device_index


class CudaAccelerator(Accelerator):
    """DeepSpeed's accelerator API on NVIDIA GPUs (zerotrain's cuda + nccl path).

    Memory figures are the caching allocator's (``torch.cuda.memory_*``); streams and events
    are ``torch.cuda``'s. Constructing one needs no GPU; calling most methods does.
    """

    name = "cuda"

    def is_synchronized_device(self) -> bool:
        """False: kernels run asynchronously to the host."""
        return False

    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cuda"``, or ``"cuda:N"`` given an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: DeviceIndex = None) -> torch.device:
        """``torch.device("cuda", device_index)``."""
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int | str | torch.device) -> None:
        """``torch.cuda.set_device``."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """``torch.cuda.current_device()``."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """``"cuda:N"`` for the current device."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """Visible GPUs."""
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        """``torch.cuda.is_available()``."""
        return torch.cuda.is_available()

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """Wait for every kernel queued on the device."""
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """``"nccl"``."""
        return "nccl"

    def is_bf16_supported(self) -> bool:
        """Whether the GPU has native bfloat16 (compute capability 8.0+). DeepSpeed also
        counts emulated bf16 on older GPUs; zerotrain's engine refuses that, so it says False."""
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)

    def is_fp16_supported(self) -> bool:
        """Compute capability 7.0+, or 6.x with ``DS_ALLOW_DEPRECATED_FP16=1``, as DeepSpeed."""
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        deprecated_ok = os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"
        return major >= 7 or (major == 6 and deprecated_ok)

    def is_triton_supported(self) -> bool:
        """Compute capability 8.0+, as DeepSpeed."""
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability()[0] >= 8

    def amp(self) -> types.ModuleType:
        """``torch.cuda.amp``."""
        return torch.cuda.amp

    def manual_seed(self, seed: int) -> None:
        """Seed the current GPU's generator."""
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every GPU's generator."""
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        """The current GPU generator's seed."""
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        """The GPU generator's state (current device when None)."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        """Restore a GPU generator's state (current device when None)."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        """``torch.cuda.default_generators[device_index]`` (current device when None)."""
        return torch.cuda.default_generators[_index(device_index)]

    @property
    def Stream(self) -> type[torch.cuda.Stream]:  # noqa: N802 (DeepSpeed's name)
        """``torch.cuda.Stream``."""
        return torch.cuda.Stream

    @property
    def Event(self) -> type[torch.cuda.Event]:  # noqa: N802 (DeepSpeed's name)
        """``torch.cuda.Event``."""
        return torch.cuda.Event

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """``torch.cuda.stream(stream)``."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream:
        """``torch.cuda.current_stream``."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: DeviceIndex = None) -> torch.cuda.Stream:
        """``torch.cuda.default_stream``."""
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        """Return the caching allocator's unused blocks to the driver."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by tensors now."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes held by tensors since the start or the last reset."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        """Restart the allocated peak (torch now resets every peak here)."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        """Restart every peak figure from the current one."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by the caching allocator (in use or cached)."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes held by the caching allocator."""
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        """``torch.cuda.memory_stats``."""
        return dict(torch.cuda.memory_stats(device_index))

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The GPU's memory size in bytes."""
        return int(torch.cuda.get_device_properties(_index(device_index)).total_memory)

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Bytes the driver reports free on the GPU (every process's use counted, as
        DeepSpeed's NVML query)."""
        free, _total = torch.cuda.mem_get_info(_index(device_index))
        return int(free)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (``tensor.pin_memory()``), for asynchronous
        host-to-GPU copies."""
        return tensor.pin_memory()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` now if CUDA is initialised, else when it is."""
        if torch.cuda.is_initialized():
            return callback()
        defer = getattr(torch.cuda, "_lazy_call", None)  # private; absent: run it now
        return callback() if defer is None else defer(callback)

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        """Open an NVTX range (``domain`` and ``category`` are accepted and unused)."""
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: str | None = None) -> Any:
        """Close the innermost NVTX range."""
        return torch.cuda.nvtx.range_pop()

    def export_envs(self) -> list[str]:
        """``["NCCL"]``: the launcher forwards every ``NCCL*`` variable."""
        return ["NCCL"]

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")
