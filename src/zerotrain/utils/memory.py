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
