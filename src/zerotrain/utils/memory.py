"""Process memory probes used by progress reporting and benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import os
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


def format_bytes(n: float) -> str:
    """Human-readable size with binary units, e.g. ``12.3 MiB``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def release_free_memory() -> None:
    """Hand memory the C allocator keeps after frees back to the OS (glibc only).

    Building a model one parameter at a time frees many differently sized blocks; glibc
    keeps them in its heap, which shows up as resident memory that nothing uses.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


def serve_large_blocks_from_mmap() -> None:
    """Make glibc map every allocation of 1 MiB or more separately (``mallopt``).

    Stage 3 frees and reallocates each unit's gathered buffer around every use. With
    glibc's default (a threshold that grows to 32 MiB), those blocks come from the heap, whose
    freed holes fragment: resident memory and address space grew by about one model size per
    step in our measurements, and an ``RLIMIT_AS`` was hit. Mapped blocks are returned to the
    OS when freed. ``ZEROTRAIN_MMAP_THRESHOLD`` overrides the size (0: leave glibc alone).
    """
    raw = os.environ.get("ZEROTRAIN_MMAP_THRESHOLD")
    threshold = MMAP_THRESHOLD_BYTES if raw is None else int(raw)
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
