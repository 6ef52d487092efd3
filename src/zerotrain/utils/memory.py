"""Process memory probes used by progress reporting and benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import resource
import sys
import threading


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
# What the last holder of LargeAllocationMapping sets: glibc's ceiling for its adaptive
# threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, mallopt(3)), where the threshold of a
# process that frees large mapped blocks (every training loop) climbs to by itself. glibc's
# *initial* 128 KiB, fixed, maps every block of 128 KiB and more for good: a plain torch GPT
# step measured 32-35 ms at 128 KiB against 21-22 ms adaptive and 21 ms at 32 MiB.
RELEASED_MMAP_THRESHOLD = 32 << 20
LARGE_ALLOCATION_BYTES = 1 << 20  # the threshold held while mapping large allocations


def _set_mmap_threshold(nbytes: int) -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # not glibc
        return False


class _Holders:
    """How many ``LargeAllocationMapping`` holds are open. Process-wide on purpose, the one
    exception to "no module-level mutable state": it mirrors glibc's threshold, of which a
    process has exactly one, so holders in different engines must share the count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.active = False  # the threshold is set (glibc accepted it)


_HOLDERS = _Holders()


class LargeAllocationMapping:
    """A hold on glibc serving every allocation of 1 MiB or more with its own mapping, which
    goes back to the OS when freed; released by ``release()`` (idempotent) or at the end
    of a ``with`` block. Holds are counted: the first sets the threshold, the last release
    sets 32 MiB, the ceiling glibc's adaptive threshold rises to by itself.

    glibc maps only blocks above a threshold that rises, as mapped blocks are freed, up to
    32 MiB; everything smaller comes from heaps that return memory only from their top.
    Tensors of a few MiB freed in the middle (swapped-out shards, replayed initial values)
    then stay resident, and resident memory grows with the model instead of staying flat.
    ``zero.Init`` (recording, and the replay in ``initialize``) and NVMe offload (for the
    ``Offload``'s life) hold it.

    glibc offers no way to read the threshold back, nor to re-enable its dynamic adjustment
    once a threshold was set: after the last release the threshold stays fixed at 32 MiB,
    where a training process's adaptive threshold ends up anyway (glibc's initial 128 KiB,
    fixed, made steps about 50% slower: every block of 128 KiB and more mapped and unmapped
    each time). A threshold the program set itself through ``mallopt`` is not restored.
    """

    def __init__(self) -> None:
        with _HOLDERS.lock:
            if _HOLDERS.count == 0:
                _HOLDERS.active = _set_mmap_threshold(LARGE_ALLOCATION_BYTES)
            _HOLDERS.count += 1
            #: whether glibc took the threshold (False off glibc)
            self.active = _HOLDERS.active
        self._held = True

    def release(self) -> None:
        """End this hold; the last one open sets the released threshold (32 MiB)."""
        with _HOLDERS.lock:
            if not self._held:
                return
            self._held = False
            _HOLDERS.count -= 1
            if _HOLDERS.count == 0 and _HOLDERS.active:
                _set_mmap_threshold(RELEASED_MMAP_THRESHOLD)
                _HOLDERS.active = False

    def __enter__(self) -> LargeAllocationMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def map_large_allocations() -> LargeAllocationMapping:
    """Map allocations of 1 MiB and more individually until the returned hold is released
    (see ``LargeAllocationMapping``; its ``active`` says whether glibc took it)."""
    return LargeAllocationMapping()


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
