"""The accelerator interface: DeepSpeed's ``DeepSpeedAccelerator`` methods, one class per device.

DeepSpeed scripts ask ``get_accelerator()`` for device names, RNG, memory figures and streams
instead of calling ``torch.cuda`` directly. :class:`Accelerator` declares the calls those
scripts make, with DeepSpeed's names and signatures; ``cpu.py`` and ``cuda.py`` answer them.
Behaviour every device shares (the timer flags derived from ``is_synchronized_device``, the
op-builder refusal, the visible-devices variables) is written here once.
"""

from __future__ import annotations

import abc
import types
from collections.abc import Callable, MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeAlias

import torch

DeviceIndex: TypeAlias = int | None
"""A device ordinal, or None for the current device (DeepSpeed's ``device_index``)."""

# What zerotrain offers instead of DeepSpeed's compiled ops, by builder name.
_OP_BUILDER_ALTERNATIVES = {
    "CPUAdamBuilder": "zerotrain's host Adam runs with offload_optimizer (no build step)",
    "FusedAdamBuilder": 'the "Adam"/"AdamW" optimizer config uses torch\'s fused kernels',
    "AsyncIOBuilder": "NVMe offload (offload_optimizer/offload_param device nvme) needs none",
}


class Accelerator(abc.ABC):
    """One device kind (``cpu`` or ``cuda``) behind DeepSpeed's accelerator API.

    Methods take ``device_index`` like DeepSpeed's: None means the current device. Results
    follow DeepSpeed's CPU and CUDA accelerators except where a docstring says otherwise.
    """

    name: str
    """``"cpu"`` or ``"cuda"`` (DeepSpeed keeps it in ``_name``, also readable here)."""

    @property
    def _name(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<zerotrain {self.name} accelerator>"

    # Timing and scheduling: a synchronized device finishes each op before returning.
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """Whether ops finish before the call returns (the CPU), so host timers are exact."""

    def use_host_timers(self) -> bool:
        """Whether wall-clock timers on the host measure device work (synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work itself without explicit waits."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether queued work can never run ahead of freed memory (synchronized devices)."""
        return self.is_synchronized_device()

    # Devices.
    @abc.abstractmethod
    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cpu"``; for CUDA ``"cuda"``, or ``"cuda:N"`` given an index."""

    @abc.abstractmethod
    def device(self, device_index: DeviceIndex = None) -> torch.device:
        """The ``torch.device`` for ``device_index``."""

    @abc.abstractmethod
    def set_device(self, device_index: int | str | torch.device) -> None:
        """Make ``device_index`` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """The current device's ordinal."""

    @abc.abstractmethod
    def current_device_name(self) -> str:
        """The current device as a string, e.g. ``"cuda:0"``."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind this process can use."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device kind can be used in this process."""

    @abc.abstractmethod
    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """Wait for all work queued on the device."""

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device: ``"gloo"`` or ``"nccl"``."""

    # Data types.
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether the device computes in bfloat16."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether the device computes in float16."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32, then float16 and bfloat16 where supported."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    @abc.abstractmethod
    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run on this device."""

    @abc.abstractmethod
    def amp(self) -> types.ModuleType:
        """The device's ``torch.<device>.amp`` module (``.autocast``, ``.GradScaler``)."""

    # Random numbers.
    def random(self) -> types.ModuleType:
        """The ``torch.random`` module."""
        return torch.random

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any:
        """Seed every device's generator."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's generator started from."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        """The generator state, a uint8 tensor."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        """Restore a state from :meth:`get_rng_state`."""

    @abc.abstractmethod
    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        """The device's default ``torch.Generator``."""

    # Streams and events.
    @property
    @abc.abstractmethod
    def Stream(self) -> type[Any]:  # noqa: N802 (DeepSpeed's name)
        """The stream class, called as ``accel.Stream()``."""

    @property
    @abc.abstractmethod
    def Event(self) -> type[Any]:  # noqa: N802 (DeepSpeed's name)
        """The event class, called as ``accel.Event(enable_timing=...)``."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """A context manager that queues work on ``stream`` inside its block."""

    @abc.abstractmethod
    def current_stream(self, device_index: DeviceIndex = None) -> Any:
        """The stream work is queued on now."""

    @abc.abstractmethod
    def default_stream(self, device_index: DeviceIndex = None) -> Any:
        """The device's default stream."""

    # Memory. ``memory_*`` figures are in bytes.
    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused memory to the device."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Bytes in use now."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes in use since the start or the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        """Restart the allocated peak from the current figure."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        """Restart every peak figure from the current one."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Bytes held by the allocator (in use or cached)."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """Peak bytes held by the allocator."""

    def memory_cached(self, device_index: DeviceIndex = None) -> int:
        """Old name of :meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: DeviceIndex = None) -> int:
        """Old name of :meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: DeviceIndex = None) -> None:
        """Old name: restarts the peak figures, as :meth:`reset_peak_memory_stats`."""
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        """Allocator statistics keyed as ``torch.cuda.memory_stats`` keys them."""

    @abc.abstractmethod
    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The device's memory size in bytes."""

    @abc.abstractmethod
    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Bytes free on the device now."""

    # Tensors.
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory where that speeds up copies to the device.

        ``align_bytes`` is accepted for DeepSpeed's signature; neither DeepSpeed's CPU nor
        its CUDA accelerator uses it, and neither does zerotrain.
        """

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in page-locked host memory."""
        return bool(tensor.is_pinned())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device kind."""
        return tensor.device.type == self.name

    # Scheduling and profiling hooks.
    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` once the device is initialised (at once on the CPU)."""
        return callback()

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        """Open a named profiler range (NVTX on CUDA; nothing on the CPU)."""
        return None

    def range_pop(self, domain: str | None = None) -> Any:
        """Close the innermost range opened by :meth:`range_push`."""
        return None

    # Compiled ops: zerotrain builds none.
    def create_op_builder(self, class_name: str) -> Any:
        """None: zerotrain compiles no ops, so no builder exists (DeepSpeed returns None
        for a builder its accelerator lacks, and scripts test for that)."""
        return None

    def get_op_builder(self, class_name: str) -> type[Any]:
        """Refuse: zerotrain has no op builders to hand out.

        Raises:
            NotImplementedError: always, naming the builder and what zerotrain offers instead.
        """
        instead = _OP_BUILDER_ALTERNATIVES.get(class_name, "its features run on torch ops")
        raise NotImplementedError(
            f"get_op_builder({class_name!r}): zerotrain compiles no DeepSpeed ops, so there is "
            f"no {class_name}; {instead}. create_op_builder() returns None for any name"
        )

    # Launcher environment.
    def visible_devices_envs(self) -> list[str]:
        """Variables that restrict the devices a process sees (CUDA's, as DeepSpeed)."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(
        self, current_env: MutableMapping[str, str], local_accelerator_ids: Sequence[int]
    ) -> None:
        """Write ``local_accelerator_ids`` (comma-separated) into each visible-devices
        variable of ``current_env``."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = value

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Prefixes of variables a launcher forwards to every node (``NCCL`` on CUDA)."""

    # DeepSpeed's typed tensor constructors, e.g. ``accel.FloatTensor([1.0, 2.0])``.
    @abc.abstractmethod
    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """The constructor behind the ``*Tensor`` properties for ``dtype``."""

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """bfloat16 tensor constructor."""
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """uint8 tensor constructor."""
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """float64 tensor constructor."""
        return self._tensor_type(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """float32 tensor constructor."""
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """float16 tensor constructor."""
        return self._tensor_type(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """int32 tensor constructor."""
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 (DeepSpeed's name)
        """int64 tensor constructor."""
        return self._tensor_type(torch.int64)
