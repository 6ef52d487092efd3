"""The CPU accelerator: DeepSpeed's ``CPU_Accelerator`` answers, on zerotrain's gloo path.

The CPU runs every op before returning, so streams and events are no-op stand-ins and host
timers are exact. Memory figures are this process's resident set size (RSS), as DeepSpeed's
CPU accelerator reports them: "allocated" and "reserved" are both the RSS now, and the peaks
are the largest RSS seen by any memory call since construction or the last reset (sampled at
those calls, not tracked in between).
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from zerotrain.accelerator.base import Accelerator, DeviceIndex
from zerotrain.utils.memory import current_rss_bytes


class HostEvent:
    """An event on the CPU: recording notes the time; every wait returns at once.

    Args:
        enable_timing: record the host time, so :meth:`elapsed_time` can answer.
        blocking, interprocess: accepted for ``torch.cuda.Event``'s signature; unused.
    """

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        """Mark this point; the CPU has finished all earlier work already."""
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """True: all work before the event is done."""
        return True

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s.

        Raises:
            RuntimeError: either event was not recorded, or was made without timing.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time needs both events made with enable_timing=True")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class HostStream:
    """A stream on the CPU: work runs in program order, so every wait returns at once.

    Args:
        device, priority: accepted for ``torch.cuda.Stream``'s signature; unused.
    """

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """True: the stream has no work pending."""
        return True

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record ``event`` (a new one when None) and return it."""
        event = event if event is not None else HostEvent()
        event.record(self)
        return event


_LEGACY_TENSOR_TYPES: dict[torch.dtype, Callable[..., torch.Tensor]] = {
    torch.bfloat16: torch.BFloat16Tensor,
    torch.uint8: torch.ByteTensor,
    torch.float64: torch.DoubleTensor,
    torch.float32: torch.FloatTensor,
    torch.float16: torch.HalfTensor,
    torch.int32: torch.IntTensor,
    torch.int64: torch.LongTensor,
}


def _numa_nodes_with_cpus() -> int:
    """NUMA nodes that have CPUs (nodes of memory alone, such as HBM, are not counted); 0
    where the kernel does not say."""
    lists = set()
    for cpulist in Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"):
        with contextlib.suppress(OSError):
            text = cpulist.read_text().strip()
            if text:
                lists.add(text)
    return len(lists)


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CpuAccelerator(Accelerator):
    """DeepSpeed's accelerator API on the CPU (zerotrain's ``ZEROTRAIN_DEVICE=cpu`` path)."""

    name = "cpu"

    def __init__(self) -> None:
        self._peak_rss = current_rss_bytes()

    def is_synchronized_device(self) -> bool:
        """True: a CPU op has finished when it returns."""
        return True

    def device_name(self, device_index: DeviceIndex = None) -> str:
        """``"cpu"``, whatever the index."""
        return "cpu"

    def device(self, device_index: DeviceIndex = None) -> torch.device:
        """``torch.device("cpu")`` (DeepSpeed returns None, which torch reads as the CPU)."""
        return torch.device("cpu")

    def set_device(self, device_index: int | str | torch.device) -> None:
        """Nothing to select on the CPU."""

    def current_device(self) -> int:
        """This process's ``LOCAL_RANK`` (0 without one), as DeepSpeed answers.

        Raises:
            ValueError: LOCAL_RANK is not an integer.
        """
        raw = os.environ.get("LOCAL_RANK", "0")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None

    def current_device_name(self) -> str:
        """``"cpu"``."""
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` when a launcher set it, else the NUMA nodes with CPUs (at least 1),
        as DeepSpeed counts CPU "devices"."""
        local_size = os.environ.get("LOCAL_SIZE", "")
        if local_size.isdigit() and int(local_size) > 0:
            return int(local_size)
        return max(1, _numa_nodes_with_cpus())

    def is_available(self) -> bool:
        """True."""
        return True

    def synchronize(self, device_index: DeviceIndex = None) -> None:
        """Nothing to wait for."""

    def communication_backend_name(self) -> str:
        """``"gloo"``, the backend zerotrain runs CPU tensors over."""
        return "gloo"

    def is_bf16_supported(self) -> bool:
        """True: torch computes bfloat16 on any CPU."""
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has float16 kernels for this CPU (AVX512-FP16 or AMX-FP16), as
        DeepSpeed answers. zerotrain's engine itself accepts fp16 on any CPU torch can
        compute it on; this answers whether it is fast."""
        try:
            probe = torch.ops.mkldnn._is_mkldnn_fp16_supported
            return bool(probe())
        except (AttributeError, RuntimeError):  # a torch build without oneDNN
            return False

    def is_triton_supported(self) -> bool:
        """False: zerotrain runs no Triton kernels on the CPU."""
        return False

    def amp(self) -> types.ModuleType:
        """``torch.cpu.amp``."""
        return torch.cpu.amp

    def manual_seed(self, seed: int) -> torch.Generator:
        """Seed torch's CPU generator (``torch.manual_seed``); returns it."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        """The CPU has one generator: same as :meth:`manual_seed`."""
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """``torch.initial_seed()``."""
        return torch.initial_seed()

    def get_rng_state(self, device_index: DeviceIndex = None) -> torch.Tensor:
        """``torch.get_rng_state()``."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: DeviceIndex = None) -> None:
        """``torch.set_rng_state(new_state)``; the index is ignored (one CPU generator)."""
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: DeviceIndex = None) -> torch.Generator:
        """``torch.default_generator``."""
        return torch.default_generator

    @property
    def Stream(self) -> type[HostStream]:  # noqa: N802 (DeepSpeed's name)
        """:class:`HostStream` (DeepSpeed's CPU accelerator returns None here)."""
        return HostStream

    @property
    def Event(self) -> type[HostEvent]:  # noqa: N802 (DeepSpeed's name)
        """:class:`HostEvent` (DeepSpeed's CPU accelerator returns None here)."""
        return HostEvent

    def stream(self, stream: Any) -> AbstractContextManager[Any]:
        """A context that changes nothing: the CPU has one queue."""
        return contextlib.nullcontext(stream)

    def current_stream(self, device_index: DeviceIndex = None) -> HostStream:
        """A :class:`HostStream` (DeepSpeed returns None)."""
        return HostStream()

    def default_stream(self, device_index: DeviceIndex = None) -> HostStream:
        """A :class:`HostStream` (DeepSpeed returns None)."""
        return HostStream()

    def empty_cache(self) -> None:
        """Nothing cached to return."""

    def _rss(self) -> int:
        rss = current_rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """This process's RSS now."""
        return self._rss()

    def max_memory_allocated(self, device_index: DeviceIndex = None) -> int:
        """The largest RSS any memory call saw since construction or the last reset."""
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: DeviceIndex = None) -> None:
        """Restart the peak from the RSS now."""
        self._peak_rss = current_rss_bytes()

    def reset_peak_memory_stats(self, device_index: DeviceIndex = None) -> None:
        """Restart the peak from the RSS now (allocated and reserved share it)."""
        self._peak_rss = current_rss_bytes()

    def memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """This process's RSS now (the same figure as :meth:`memory_allocated`)."""
        return self._rss()

    def max_memory_reserved(self, device_index: DeviceIndex = None) -> int:
        """The peak RSS, as :meth:`max_memory_allocated`."""
        return self.max_memory_allocated(device_index)

    def memory_stats(self, device_index: DeviceIndex = None) -> dict[str, Any]:
        """``allocated_bytes.all.current`` (RSS now) and ``allocated_bytes.all.peak``."""
        current = self._rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: DeviceIndex = None) -> int:
        """The machine's physical memory in bytes."""
        total = _meminfo_bytes("MemTotal")
        if total is not None:
            return total
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: DeviceIndex = None) -> int:
        """Memory the kernel could hand out without swapping (``MemAvailable``)."""
        available = _meminfo_bytes("MemAvailable")
        if available is not None:
            return available
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` itself: with no device to copy to, pinning buys nothing (DeepSpeed's
        CPU accelerator does the same)."""
        return tensor

    def export_envs(self) -> list[str]:
        """None to forward."""
        return []

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        # DeepSpeed hands out torch's legacy CPU types here (torch.FloatTensor, ...).
        return _LEGACY_TENSOR_TYPES[dtype]
