"""Swap files under ``nvme_path``: where offloaded tensors live between uses.

Each rank gets its own directory (``zerotrain-swap-<host>-<pid>-rank<r>-<random>``) holding
one file per purpose (optimizer states, parameter shards). A file is a sequence of regions,
one per tensor, each starting on a 4 KiB boundary and padded to one, so whole regions can
bypass the page cache and no two regions share a page. Space is reserved when a region is
allocated (``posix_fallocate``), so a full disk fails while the run is set up, not hours into
it. The directory and the files it created are removed on ``close()``, and at interpreter
exit if nobody closed it; nothing else is ever removed.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from zerotrain.comm import liveness
from zerotrain.offload.aio import ALIGNMENT, AsyncFileIO, IOFuture, SwapError
from zerotrain.utils.logging import get_logger
from zerotrain.utils.memory import format_bytes

__all__ = [
    "SwapDirectory",
    "SwapError",
    "SwapFile",
    "SwapRegion",
    "aligned_empty",
    "check_nvme_path",
]

log = get_logger(__name__)

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# posix_fallocate errors meaning "this filesystem cannot reserve", not "there is no space".
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def check_nvme_path(
    path: str | os.PathLike[str],
    needed_bytes: int,
    what: str,
    *,
    needed_for: str = "the offloaded states of every rank on this machine that uses it",
) -> Path:
    """Check that an offload directory is usable before anything is written to it.

    Args:
        path: the configured directory.
        needed_bytes: bytes the swap files will take there.
        what: the config key that set ``path`` (named in every error), e.g.
            ``"zero_optimization.offload_optimizer.nvme_path"``.
        needed_for: what needs the space (completes the "too small" message).

    Returns:
        ``path``, resolved.

    Raises:
        SwapError: ``path`` is empty, does not exist, is not a directory, is not writable
            (creating a file there failed) or has fewer than ``needed_bytes`` free.
        ValueError: ``needed_bytes`` < 0.
    """
    if needed_bytes < 0:
        raise ValueError(f"needed_bytes must be >= 0, got {needed_bytes}")
    given = os.fspath(path)
    if not given:
        raise SwapError(f"{what} is empty; set it to a directory on a fast local disk (NVMe)")
    try:
        root = Path(given).expanduser().resolve()
        exists, is_dir = root.exists(), root.is_dir()
    except (OSError, RuntimeError) as error:  # a parent this user may not search; link loops
        raise SwapError(f"{what} = {given!r} cannot be inspected: {error}") from error
    if not exists:
        raise SwapError(
            f"{what} = {given!r} does not exist; create it (mkdir -p {str(root)!r}) or point "
            f"{what} at an existing directory on a fast local disk"
        )
    if not is_dir:
        raise SwapError(
            f"{what} = {given!r} is not a directory; {what} must name a directory, in which "
            "zerotrain creates its own per-rank subdirectory"
        )
    _check_writable(root, given, what)
    free = shutil.disk_usage(root).free
    if free < needed_bytes:
        raise SwapError(
            f"{what} = {given!r} has {format_bytes(free)} free, but {format_bytes(needed_bytes)} "
            f"are needed there for {needed_for}; free space or point {what} at a larger disk"
        )
    return root


def _check_writable(root: Path, given: str, what: str) -> None:
    """Create and remove a file in ``root``: the only reliable test (ACLs, read-only
    mounts and root squash all defeat ``os.access``)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".zerotrain-probe-", dir=root)
    except OSError as error:
        raise SwapError(
            f"{what} = {given!r} is not writable: creating a file there failed ({error}); "
            f"choose a directory this user (uid {os.getuid()}) can write to"
        ) from error
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def aligned_empty(
    numel: int, dtype: torch.dtype, *, alignment: int = ALIGNMENT, pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``alignment`` boundary.

    Staging buffers for swap I/O are made with this so that whole transfers qualify for
    ``O_DIRECT`` (the CPU allocator only aligns to 64 bytes).

    Args:
        numel: elements (>= 0).
        dtype: element type.
        alignment: byte boundary of the data pointer (a power of two).
        pin: page-locked memory where CUDA is available (faster device copies); ignored
            otherwise.

    Returns:
        A tensor of shape ``(numel,)``; a view into a slightly larger storage.
    """
    if numel < 0:
        raise ValueError(f"aligned_empty numel must be >= 0, got {numel}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty alignment must be a power of two, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    pinned = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pinned)
    skip = (-raw.data_ptr()) % alignment
    return raw[skip : skip + nbytes].view(dtype)


class SwapRegion:
    """``numel`` elements of ``dtype`` at byte ``offset`` (a multiple of 4096) of ``file``.

    Made by :meth:`SwapFile.allocate`; reads as zeros until written.
    """

    def __init__(self, file: SwapFile, offset: int, numel: int, dtype: torch.dtype) -> None:
        self.file = file
        self.offset = offset
        self.numel = numel
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * self.itemsize

    def read(self, out: torch.Tensor, start: int = 0) -> IOFuture:
        """Start reading elements ``[start, start + out.numel())`` of the region into ``out``.

        Args:
            out: a contiguous CPU tensor of the region's dtype (any shape).
            start: first element of the region to read.

        Raises:
            ValueError: wrong dtype, not contiguous on CPU, or outside the region.
            SwapError: the file or the I/O pool was closed (I/O failures: at ``wait()``).
        """
        self._check(out, start, "reading")
        return self.file.io.read(self.file, self.offset + start * self.itemsize, out)

    def write(self, src: torch.Tensor, start: int = 0) -> IOFuture:
        """Start writing ``src`` into elements ``[start, start + src.numel())``; ``src`` must
        not change until the future completes. Raises: as :meth:`read`."""
        self._check(src, start, "writing")
        return self.file.io.write(self.file, self.offset + start * self.itemsize, src)

    def _check(self, tensor: torch.Tensor, start: int, verb: str) -> None:
        if tensor.dtype != self.dtype:
            raise ValueError(
                f"{verb} a {tensor.dtype} tensor from/to a swap region of {self.dtype} "
                f"({self.file.path} at offset {self.offset}); the dtypes must match"
            )
        end = start + tensor.numel()
        if start < 0 or end > self.numel:
            raise ValueError(
                f"{verb} elements [{start}, {end}) of a swap region of {self.numel} elements "
                f"({self.file.path} at offset {self.offset}); allowed: 0 <= start and "
                f"start + numel <= {self.numel}"
            )

    def __repr__(self) -> str:
        return (
            f"SwapRegion({self.file.path.name}, offset={self.offset}, numel={self.numel}, "
            f"dtype={self.dtype})"
        )


class SwapFile:
    """One file of tensor regions, each starting at a 4096-aligned offset.

    Args:
        path: the file to create (it must not exist).
        io: the pool that reads and writes it.
        rank: prefixes error messages (``"rank 3: ..."``) when given.

    Two descriptors are kept: a buffered one, and an ``O_DIRECT`` one (``direct_fd``) where
    the filesystem allows it (tmpfs does not: then everything is buffered).
    """

    def __init__(self, path: Path, io: AsyncFileIO, *, rank: int | None = None) -> None:
        self.path = Path(path)
        self.io = io
        self.label = "" if rank is None else f"rank {rank}: "
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise SwapError(f"{self.label}cannot create swap file {self.path}: {error}") from error
        self._direct_fd = _open_direct(self.path)
        self._direct_ok = self._direct_fd is not None
        self._fallocate = hasattr(os, "posix_fallocate")
        self._size = 0
        self._closed = False
        self._users = 0  # transfers inside descriptors(); close() waits for them
        self._cond = threading.Condition()

    @property
    def direct_fd(self) -> int | None:
        """The ``O_DIRECT`` descriptor, or None where direct I/O is unavailable."""
        return self._direct_fd if self._direct_ok else None

    @property
    def size_bytes(self) -> int:
        """Bytes reserved by :meth:`allocate` (regions padded to 4096 bytes)."""
        return self._size

    @property
    def closed(self) -> bool:
        return self._closed

    def allocate(self, numel: int, dtype: torch.dtype) -> SwapRegion:
        """Reserve a new region for ``numel`` elements of ``dtype`` at the end of the file.

        Raises:
            ValueError: ``numel`` < 0.
            SwapError: the file is closed, or the space cannot be reserved (disk full).
        """
        if numel < 0:
            raise ValueError(f"swap region numel must be >= 0, got {numel}")
        with self._cond:
            if self._closed:
                raise SwapError(f"{self.label}{self.path} was closed; cannot allocate in it")
            region = SwapRegion(self, self._size, numel, dtype)
            padded = -(-region.nbytes // ALIGNMENT) * ALIGNMENT
            if padded:
                self._reserve(self._size, padded)
            self._size += padded
        return region

    def _reserve(self, offset: int, length: int) -> None:
        if self._fallocate:
            try:
                os.posix_fallocate(self.fd, offset, length)
                return
            except OSError as error:
                if error.errno not in _NO_FALLOCATE:
                    raise self._reserve_error(length, error) from error
                log.debug("%s: posix_fallocate unsupported (%s); using ftruncate", self.path, error)
                self._fallocate = False
        # Sparse: a full disk then shows up as a failed write instead.
        try:
            os.ftruncate(self.fd, offset + length)
        except OSError as error:
            raise self._reserve_error(length, error) from error

    def _reserve_error(self, length: int, error: OSError) -> SwapError:
        free = shutil.disk_usage(self.path.parent).free
        return SwapError(
            f"{self.label}cannot reserve {format_bytes(length)} for a swap region in {self.path} "
            f"(already {format_bytes(self._size)}; {format_bytes(free)} free on that "
            f"filesystem): {error}"
        )

    @contextlib.contextmanager
    def descriptors(self) -> Iterator[tuple[int, int | None]]:
        """``(buffered_fd, direct_fd or None)``, kept open until the block exits.

        Used by the I/O threads: ``close()`` waits for transfers in progress, so a descriptor
        is never closed (and its number reused by another file) under a system call.
        """
        with self._cond:
            if self._closed:
                raise SwapError(f"{self.label}{self.path} was closed before this transfer ran")
            self._users += 1
        try:
            yield self.fd, self.direct_fd
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    self._cond.notify_all()

    def disable_direct(self, error: OSError) -> None:
        """Stop using ``O_DIRECT`` (the filesystem refused a transfer that should qualify)."""
        if self._direct_ok:
            self._direct_ok = False
            log.debug("%s: O_DIRECT transfer refused (%s); using buffered I/O", self.path, error)

    def close(self) -> None:
        """Close the descriptors once transfers in progress finish (idempotent); queued
        transfers then fail at ``wait()``. The file itself stays (see SwapDirectory)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.wait_for(lambda: self._users == 0)
        for fd in (self.fd, self._direct_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{format_bytes(self._size)}"
        return f"SwapFile({self.path}, {state}, direct={self.direct_fd is not None})"


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDWR | flag)
    except OSError as error:  # tmpfs and some network filesystems refuse O_DIRECT
        log.debug("%s: no O_DIRECT (%s); using buffered I/O", path, error)
        return None


_SWAP_PREFIX = "zerotrain-swap-"
_OPEN_DIRECTORIES: set[SwapDirectory] = set()
_STALE_AFTER = 60.0  # seconds untouched before a dead owner's directory is swept


#: Where ``zerotrain run`` asks its ranks to note their swap directories (one file per
#: directory, holding its path), so that it can remove them when the ranks end, however they
#: end (SIGKILL and the OOM killer leave no chance to clean up).
REGISTRY_ENV = "ZEROTRAIN_SWAP_REGISTRY"


def _remove_swap_directory(path: Path) -> None:
    """Remove ``path``'s ``*.swp`` files and then the directory (left, with an OSError,
    if anything else is in it)."""
    for swap in path.glob("*.swp"):
        swap.unlink()
    path.rmdir()


def _register(path: Path) -> None:
    """Note ``path`` in the launcher's registry, when there is one."""
    registry = os.environ.get(REGISTRY_ENV)
    if not registry:
        return
    try:
        (Path(registry) / path.name).write_text(str(path))
    except OSError as error:  # the launcher's sweep then misses it; the next job sweeps it
        log.warning("could not note swap directory %s in %s: %s", path, registry, error)


def remove_registered_swap_directories(registry: Path) -> list[Path]:
    """Remove the swap directories noted in ``registry`` (by ranks started with
    :data:`REGISTRY_ENV` set to it) whose process is gone; returns those removed (each
    logged). Run by ``zerotrain run`` once its ranks ended."""
    removed = []
    for entry in sorted(Path(registry).iterdir()):
        path = Path(entry.read_text())
        owner = path.name[len(_SWAP_PREFIX) :].split("-")[-3]  # <host>-<tag>-rank<r>-<random>
        if not liveness.tag_owner_gone(owner):
            continue  # still running (a rank torchrun did not end): its own exit removes it
        try:
            if path.is_dir():
                _remove_swap_directory(path)
                log.info("removed swap directory %s (its rank ended without removing it)", path)
                removed.append(path)
            entry.unlink()
        except OSError as error:
            log.warning("could not remove the swap directory %s: %s", path, error)
    return removed


def remove_stale_swap_directories(root: Path) -> list[Path]:
    """Remove swap directories under ``root`` whose owner is gone: made on this host, in
    this PID namespace, by a process that no longer exists (killed, SIGKILL or a crash,
    before it could clean up), untouched for a minute. Only ``*.swp`` files and the then
    empty directory are removed; returns the directories removed (each logged)."""
    host = socket.gethostname()
    removed = []
    for path in Path(root).glob(f"{_SWAP_PREFIX}{host}-*"):
        owner = path.name[len(_SWAP_PREFIX) + len(host) + 1 :].split("-", 1)[0]
        try:
            if not liveness.tag_owner_gone(owner):
                continue
            if time.time() - path.stat().st_mtime < _STALE_AFTER:
                continue
            _remove_swap_directory(path)
        except OSError as error:
            log.warning("could not remove the stale swap directory %s: %s", path, error)
            continue
        log.info("removed stale swap directory %s (its process %s is gone)", path, owner)
        removed.append(path)
    return removed


def close_open_directories() -> None:
    """Close every swap directory of this process, as its exit would (SIGTERM, a test pool
    between tests)."""
    for directory in list(_OPEN_DIRECTORIES):
        with contextlib.suppress(Exception):
            directory.close()


def _close_open_directories_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler cancelling the job): remove the swap files, then let the
    signal do what it did before (the default: terminate)."""
    close_open_directories()
    signal.signal(signal.SIGTERM, _PREVIOUS_SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)


_PREVIOUS_SIGTERM: Any = signal.SIG_DFL
_SIGTERM_INSTALLED = False


def _clean_up_on_sigterm() -> None:
    """Install the SIGTERM clean-up once, from the main thread, in front of whatever
    handler was there (it runs after the clean-up)."""
    global _PREVIOUS_SIGTERM, _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return  # the process ignores SIGTERM: nothing will end it that way
    _PREVIOUS_SIGTERM = previous if previous is not None else signal.SIG_DFL
    signal.signal(signal.SIGTERM, _close_open_directories_on_sigterm)
    _SIGTERM_INSTALLED = True


class SwapDirectory:
    """This rank's directory of swap files under ``root``.

    Created as ``root/zerotrain-swap-<host>-<pid>.<pid namespace>-rank<r>-<random>/`` (the
    random suffix keeps a stale directory of an earlier run with the same pid, common in
    containers, from colliding). Removed on :meth:`close`, at interpreter exit if still
    open, and on SIGTERM (a scheduler cancelling the job); only the files it created and
    the directory itself are removed, so anything else put there survives (and keeps the
    directory, with a warning). Directories of processes killed outright (SIGKILL) are
    removed by the next one made under the same root (:func:`remove_stale_swap_directories`).

    Args:
        root: a checked offload directory (see :func:`check_nvme_path`).
        rank: this process's rank (in the name and in error messages).
        io: the pool that reads and writes the files.
    """

    def __init__(self, root: Path, rank: int, io: AsyncFileIO) -> None:
        root = Path(root)
        if not root.is_dir():
            raise SwapError(f"rank {rank}: swap root {root} is not a directory")
        remove_stale_swap_directories(root)
        prefix = f"{_SWAP_PREFIX}{socket.gethostname()}-{liveness.process_tag()}-rank{rank}-"
        try:
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        except OSError as error:
            raise SwapError(
                f"rank {rank}: cannot create a swap directory in {root}: {error}"
            ) from error
        _register(self.path)
        self.rank = rank
        self.io = io
        self._files: dict[str, SwapFile] = {}
        self._lock = threading.RLock()  # re-entered by the SIGTERM clean-up
        self._closed = False
        self._owner_pid = os.getpid()
        # A strong reference until close(): the files must outlive every region handed out.
        atexit.register(self._close_at_exit)
        _OPEN_DIRECTORIES.add(self)
        _clean_up_on_sigterm()

    def file(self, name: str) -> SwapFile:
        """The swap file ``name`` (``<name>.swp``), created on first use.

        Raises:
            ValueError: ``name`` is not a plain file name (letters, digits, ``_.-``).
            SwapError: the directory was closed.
        """
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(
                f"swap file name {name!r} is not allowed; use letters, digits, '_', '.' and "
                "'-', starting with a letter or digit"
            )
        with self._lock:
            if self._closed:
                raise SwapError(f"rank {self.rank}: {self.path} was closed; cannot open {name!r}")
            if name not in self._files:
                path = self.path / f"{name}.swp"
                self._files[name] = SwapFile(path, self.io, rank=self.rank)
            return self._files[name]

    @property
    def disk_bytes(self) -> int:
        """Bytes reserved across this directory's files."""
        with self._lock:
            return sum(f.size_bytes for f in self._files.values())

    def close(self) -> None:
        """Close the files and remove them and the directory (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            files = list(self._files.values())
        atexit.unregister(self._close_at_exit)
        _OPEN_DIRECTORIES.discard(self)
        for swap in files:
            swap.close()
            try:
                swap.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as error:
                log.warning("could not remove swap file %s: %s", swap.path, error)
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as error:  # not empty: someone else's files, which we leave alone
            log.warning("left swap directory %s in place: %s", self.path, error)

    def _close_at_exit(self) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked child inherited the handler; the directory is not its to remove
        try:
            self.close()
        except Exception as error:
            log.warning("removing swap directory %s at exit failed: %s", self.path, error)

    def __enter__(self) -> SwapDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapDirectory({self.path}, files={sorted(self._files)}, closed={self._closed})"
