"""Process memory probes used by progress reporting and benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except OSError:
        return 0
    return resident_pages * resource.getpagesize()


def format_bytes(n: float, decimals: int = 1) -> str:
    """Human-readable size with binary units, e.g. ``12.3 MiB`` (``decimals`` digits after
    the point; whole bytes have none)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.{decimals}f} {units[i]}"


def release_free_memory() -> None:
    """Hand memory the C allocator keeps after frees back to the OS (glibc only).

    Building a model one parameter at a time frees many differently sized blocks; glibc
    keeps them in its heap, which shows up as resident memory that nothing uses.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Serve every allocation of ``threshold`` bytes or more with its own mapping, which is
    returned to the OS when freed (glibc only; returns whether it took effect).

    glibc maps only blocks above a threshold that rises, as mapped blocks are freed, up to
    32 MiB; everything smaller comes from heaps that return memory only from their top.
    Tensors of a few MiB freed in the middle (swapped-out shards, replayed initial values)
    then stay resident, and resident memory grows with the model instead of staying flat.
    Setting the threshold fixes it for the process.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class PeakRSSMeter:
    """Peak resident memory over a block of code, above the resident memory at its start.

    Resets the kernel's high-water mark on entry (``/proc/self/clear_refs``, Linux >= 4.0)
    and reads it on exit, so every page touched counts, however briefly. Freed memory
    only leaves the resident set if the C allocator returns it: start the process with
    ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc) so that tensors are mapped and unmapped
    individually instead of being kept in the heap.

    Raises:
        OSError: on entry, where the high-water mark cannot be reset.
    """

    def __init__(self) -> None:
        self.start_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> PeakRSSMeter:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start_bytes = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = _status_kib("VmHWM") * 1024

    @property
    def increase_bytes(self) -> int:
        """Peak minus start."""
        return self.peak_bytes - self.start_bytes
