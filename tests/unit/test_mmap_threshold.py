"""``utils.memory.map_large_allocations`` leaves no allocator setting behind: holds are
counted, and the last release lifts the 1 MiB mmap threshold again (to 32 MiB, where
glibc's adaptive threshold climbs in a training process).

glibc cannot report its threshold, so the probe watches what it does: after trimming the
heap, a 4 MiB ``malloc`` is mapped (``mallinfo2().hblks`` grows) exactly when the
threshold is at most 4 MiB. The threshold is process state, so each case runs in a fresh
interpreter.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _GLIBC = hasattr(_LIBC, "mallinfo2") and hasattr(_LIBC, "mallopt")
except OSError:
    _GLIBC = False

pytestmark = pytest.mark.skipif(not _GLIBC, reason="needs glibc >= 2.33 (mallinfo2)")

_PROBE = """
import ctypes

from zerotrain.utils.memory import map_large_allocations

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def mapped(count=8, nbytes=4 << 20):
    # How many of ``count`` blocks of ``nbytes`` glibc mapped on their own (the heap's
    # free top is trimmed first, so that it cannot serve them).
    libc.malloc_trim(0)
    before = libc.mallinfo2().hblks
    blocks = [libc.malloc(nbytes) for _ in range(count)]
    after = libc.mallinfo2().hblks
    for block in blocks:
        libc.free(block)
    return after - before
"""


def _run(body: str) -> str:
    code = _PROBE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_last_release_restores_the_initial_threshold() -> None:
    out = _run(
        """
        hold = map_large_allocations()
        assert hold.active
        held = mapped()
        hold.release()
        print(held, mapped())
        """
    )
    held, released = map(int, out.split())
    assert held == 8  # 4 MiB blocks are mapped while 1 MiB is the threshold
    assert released == 0  # and come from the heap again once the hold is released


def test_holds_are_counted_and_release_is_idempotent() -> None:
    out = _run(
        """
        first = map_large_allocations()
        with map_large_allocations() as second:
            assert second.active
        first_still = mapped()  # the second hold's end leaves the first one's setting
        second.release()  # released already: must not end the first hold
        after_repeat = mapped()
        first.release()
        print(first_still, after_repeat, mapped())
        """
    )
    first_still, after_repeat, released = map(int, out.split())
    assert first_still == 8
    assert after_repeat == 8
    assert released == 0
