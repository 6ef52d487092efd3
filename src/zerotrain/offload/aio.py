"""Asynchronous reads and writes between CPU tensors and swap files.

A small pool of threads issues positioned ``preadv`` / ``pwritev`` calls, which release the
GIL, so training computes while the disk works. A large request is cut into blocks of
``block_bytes`` spread over the threads: several large sequential requests in flight keep an
NVMe drive busy, one at a time does not.

Where the memory address, the file offset and the length are all multiples of 4 KiB a block
bypasses the page cache (``O_DIRECT``): swapped states are touched once per step, and through
the cache they would push everything else out of it and cost a second copy. Whatever is not
on that grid (the partial first and last page of a request) goes through the ordinary file
descriptor. Linux keeps the two coherent: a direct transfer first writes back dirty cached
pages of its range and a direct write drops them afterwards, and a partial page is never
also part of a direct transfer of the same request (regions start on page boundaries, so
different regions never share a page either).

Errors are never lost in a thread: each block records its failure, and ``IOFuture.wait()``
raises it as a :class:`SwapError` naming the file, the offset, the size and the OS error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerotrain.utils.logging import get_logger

if TYPE_CHECKING:
    from zerotrain.offload.swap import SwapFile

log = get_logger(__name__)

ALIGNMENT = 4096
"""Granularity of direct I/O: memory address, file offset and length must be multiples."""


class SwapError(RuntimeError):
    """An offload path is unusable, or reading or writing a swap file failed.

    Defined here (and re-exported by ``offload/swap.py``) so that the I/O threads can raise
    it without an import cycle.
    """


@dataclass(frozen=True, slots=True)
class Part:
    """One system-call-sized piece of a request: ``length`` bytes at ``start`` (relative to
    the request) moved through the direct descriptor or the buffered one."""

    start: int
    length: int
    direct: bool


def plan_parts(
    offset: int, address: int, nbytes: int, block_bytes: int, direct_ok: bool
) -> list[Part]:
    """Cut a request of ``nbytes`` at file ``offset`` from memory ``address`` into parts.

    The partial page at either end is buffered; the aligned body, when memory and file are on
    the same 4 KiB grid, is direct; everything is cut into at most ``block_bytes`` pieces.
    """
    head = min((-offset) % ALIGNMENT, nbytes)
    if not direct_ok or (address + head) % ALIGNMENT or nbytes - head < ALIGNMENT:
        return _blocks(0, nbytes, block_bytes, direct=False)
    body = (nbytes - head) // ALIGNMENT * ALIGNMENT
    tail = nbytes - head - body
    return [
        *_blocks(0, head, block_bytes, direct=False),
        *_blocks(head, body, block_bytes, direct=True),
        *_blocks(head + body, tail, block_bytes, direct=False),
    ]


def _blocks(start: int, length: int, block_bytes: int, *, direct: bool) -> list[Part]:
    return [
        Part(start + s, min(block_bytes, length - s), direct) for s in range(0, length, block_bytes)
    ]


class IOFuture:
    """One read or write in flight.

    ``wait()`` blocks until every block of the request is done, then raises the first
    failure (if any) as :class:`SwapError`. The tensor is referenced until then, so its
    memory cannot be freed under the threads (resizing its storage is still the caller's
    responsibility: do not).
    """

    def __init__(self, tensor: torch.Tensor | None, parts: int, what: str) -> None:
        self._tensor = tensor
        self._remaining = parts
        self._what = what
        self._error: SwapError | None = None
        self._retrieved = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        if parts == 0:
            self._tensor = None
            self._done.set()

    def done(self) -> bool:
        """True once every block finished (successfully or not); never blocks."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the transfer is complete.

        Raises:
            SwapError: a block failed; the message names the file, offset, size and OS error.
        """
        self._done.wait()
        if self._error is not None:
            self._retrieved = True
            raise self._error

    def _part_done(self, error: SwapError | None) -> bool:
        """Record one finished block (worker thread); True for the request's last one."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            return self._remaining == 0

    def _complete(self) -> None:
        self._tensor = None  # the bytes have landed; the caller owns the memory again
        self._done.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"IOFuture({self._what}, {state})"

    def __del__(self) -> None:
        # A failure nobody waited for would otherwise vanish silently.
        if self._error is not None and not self._retrieved:
            # Logging may already be torn down at interpreter exit.
            with contextlib.suppress(Exception):
                log.warning("swap I/O failed and nobody waited for it: %s", self._error)


class AsyncFileIO:
    """A pool of threads doing positioned reads and writes between CPU tensors and files.

    Args:
        threads: worker threads, i.e. system calls in flight at once (>= 1).
        block_bytes: the most bytes one system call moves (>= 4096; rounded down to a
            multiple of 4096 so that the blocks of an aligned request stay aligned).

    Counters (for a wall-clock breakdown): ``bytes_read``, ``bytes_written`` (bytes moved
    successfully), ``busy_seconds`` (summed over the threads, so up to ``threads`` times the
    wall time) and ``pending`` (requests not yet complete).
    """

    def __init__(self, threads: int = 2, block_bytes: int = 8 << 20) -> None:
        if threads < 1:
            raise ValueError(f"AsyncFileIO threads must be >= 1, got {threads}")
        if block_bytes < ALIGNMENT:
            raise ValueError(
                f"AsyncFileIO block_bytes must be >= {ALIGNMENT} (one page), got {block_bytes}"
            )
        self.threads = threads
        self.block_bytes = block_bytes // ALIGNMENT * ALIGNMENT
        self.bytes_read = 0
        self.bytes_written = 0
        self.busy_seconds = 0.0
        self._pending = 0
        self._closed = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerotrain-aio")

    @property
    def pending(self) -> int:
        """Requests issued and not yet complete."""
        return self._pending

    def read(self, file: SwapFile, offset: int, out: torch.Tensor) -> IOFuture:
        """Start filling ``out`` (a contiguous CPU tensor) with ``file``'s bytes from byte
        ``offset``.

        Raises:
            ValueError: ``out`` is not a contiguous CPU tensor with memory, or ``offset`` < 0.
            SwapError: this pool or ``file`` was closed.
        """
        return self._submit(file, offset, out, write=False)

    def write(self, file: SwapFile, offset: int, src: torch.Tensor) -> IOFuture:
        """Start storing ``src``'s bytes (a contiguous CPU tensor) in ``file`` at byte
        ``offset``; ``src`` must not change until the future completes.

        Raises: as :meth:`read`.
        """
        return self._submit(file, offset, src, write=True)

    def close(self) -> None:
        """Finish the queued requests and stop the threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)

    def _submit(self, file: SwapFile, offset: int, tensor: torch.Tensor, write: bool) -> IOFuture:
        verb = "writing" if write else "reading"
        if self._closed:  # checked again under the lock; this one also covers empty requests
            raise self._closed_error(verb, file)
        address, nbytes = _check_buffer(tensor, offset)
        if file.closed:
            raise SwapError(f"{file.label}{file.path} was closed; it cannot be read or written")
        parts = plan_parts(offset, address, nbytes, self.block_bytes, file.direct_fd is not None)
        future = IOFuture(tensor, len(parts), f"{verb} {nbytes} bytes at offset {offset}")
        if not parts:
            return future
        view = _byte_view(address, nbytes)
        with self._lock:
            if self._closed:
                raise self._closed_error(verb, file)
            self._pending += 1
            for part in parts:
                # Each queued job references the future, hence the tensor, until it ran.
                self._pool.submit(self._run, future, file, offset, view, part, write)
        return future

    @staticmethod
    def _closed_error(verb: str, file: SwapFile) -> SwapError:
        return SwapError(
            f"{file.label}the swap I/O pool was closed (AsyncFileIO.close()); cannot start "
            f"{verb} {file.path}"
        )

    def _run(
        self,
        future: IOFuture,
        file: SwapFile,
        offset: int,
        view: memoryview,
        part: Part,
        write: bool,
    ) -> None:
        started = time.perf_counter()
        error: SwapError | None = None
        block = view[part.start : part.start + part.length]
        try:
            with file.descriptors() as (fd, direct_fd):
                use_direct = part.direct and direct_fd is not None
                _transfer(
                    file, fd, direct_fd if use_direct else None, block, offset + part.start, write
                )
        except Exception as exc:  # any failure, OSError or not, must reach wait()
            error = _describe(exc, file, offset + part.start, part.length, write, future)
        with self._lock:
            self.busy_seconds += time.perf_counter() - started
            if error is None and write:
                self.bytes_written += part.length
            elif error is None:
                self.bytes_read += part.length
        if future._part_done(error):
            with self._lock:
                self._pending -= 1
            future._complete()


def _check_buffer(tensor: torch.Tensor, offset: int) -> tuple[int, int]:
    """(address, nbytes) of a tensor the threads may read or write as raw memory."""
    if offset < 0:
        raise ValueError(f"swap file offset must be >= 0, got {offset}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"swap I/O needs a contiguous CPU tensor, got device={tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    end = (tensor.storage_offset() * tensor.element_size()) + nbytes
    if nbytes and tensor.untyped_storage().nbytes() < end:
        # A swapped-out tensor (storage resized to 0): its data pointer is not memory we own.
        raise ValueError(
            f"swap I/O on a tensor whose storage holds {tensor.untyped_storage().nbytes()} "
            f"bytes but the tensor spans {end}; is it swapped out (storage freed)?"
        )
    return tensor.data_ptr(), nbytes


def _byte_view(address: int, nbytes: int) -> memoryview:
    """Writable bytes at ``address`` without a copy.

    Made from the data pointer rather than with ``tensor.numpy()``, which marks the storage
    as not resizable for good (swapped tensors free and regrow theirs). The future keeps the
    tensor alive while the view is in use.
    """
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _transfer(
    file: SwapFile, fd: int, direct_fd: int | None, block: memoryview, offset: int, write: bool
) -> None:
    """Move all of ``block`` (system calls may move fewer bytes than asked: loop)."""
    done = 0
    while done < len(block):
        part = block[done:]
        use = fd
        if (
            direct_fd is not None
            and (offset + done) % ALIGNMENT == 0
            and len(part) % ALIGNMENT == 0
        ):
            use = direct_fd  # a short direct transfer can leave the grid: then buffered
        try:
            n = (
                os.pwritev(use, [part], offset + done)
                if write
                else os.preadv(use, [part], offset + done)
            )
        except OSError as exc:
            if use != direct_fd or exc.errno != errno.EINVAL:
                raise
            # The filesystem accepted O_DIRECT at open but refuses these transfers.
            file.disable_direct(exc)
            direct_fd = None
            continue
        if n == 0:
            raise EOFError(
                f"the file ends before byte {offset + done} (truncated, or the region was "
                "never allocated)"
            )
        done += n


def _describe(
    exc: Exception, file: SwapFile, offset: int, nbytes: int, write: bool, future: IOFuture
) -> SwapError:
    verb = "writing" if write else "reading"
    error = SwapError(
        f"{file.label}{verb} {nbytes} bytes at offset {offset} of {file.path} failed "
        f"(part of {future._what}): {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error
