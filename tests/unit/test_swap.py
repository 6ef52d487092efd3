"""Swap files and their asynchronous I/O: bytes come back exactly as written, on and off the
O_DIRECT grid; errors reach ``wait()``; bad ``nvme_path`` values fail with a clear message;
nothing outside the swap directory is ever removed."""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from zerotrain.offload import aio
from zerotrain.offload.aio import ALIGNMENT, AsyncFileIO, plan_parts
from zerotrain.offload.swap import (
    SwapDirectory,
    SwapError,
    SwapFile,
    SwapRegion,
    aligned_empty,
    check_nvme_path,
)

# Small blocks so that modest tensors still split into several parts over the threads.
BLOCK = 64 << 10


@pytest.fixture
def io() -> Iterator[AsyncFileIO]:
    pool = AsyncFileIO(threads=3, block_bytes=BLOCK)
    yield pool
    pool.close()


@pytest.fixture
def swap_dir(tmp_path: Path, io: AsyncFileIO) -> Iterator[SwapDirectory]:
    directory = SwapDirectory(tmp_path, rank=0, io=io)
    yield directory
    directory.close()


def _values(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).to(dtype)


def _misaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose data pointer is off the 4 KiB grid."""
    base = aligned_empty(numel + 64, dtype)
    return base[3 : 3 + numel]


# -- request planning --------------------------------------------------------------------------


def test_plan_aligned_request_is_direct_in_blocks() -> None:
    parts = plan_parts(
        offset=8192, address=4096 * 7, nbytes=3 * BLOCK, block_bytes=BLOCK, direct_ok=True
    )
    assert [(p.start, p.length, p.direct) for p in parts] == [
        (0, BLOCK, True),
        (BLOCK, BLOCK, True),
        (2 * BLOCK, BLOCK, True),
    ]


def test_plan_splits_partial_pages_off_a_same_grid_request() -> None:
    # Memory and file 100 bytes past a page: the head and tail are buffered, the body direct.
    parts = plan_parts(
        offset=4096 + 100, address=8192 + 100, nbytes=20000, block_bytes=BLOCK, direct_ok=True
    )
    assert [(p.start, p.length, p.direct) for p in parts] == [
        (0, 3996, False),
        (3996, 12288, True),
        (16284, 3716, False),
    ]


@pytest.mark.parametrize(
    ("offset", "address", "nbytes", "direct_ok"),
    [
        (0, 64, 5 * BLOCK, True),  # memory off the grid
        (4096, 8192, 5 * BLOCK, False),  # no O_DIRECT descriptor
        (100, 100, 3000, True),  # less than a page
    ],
)
def test_plan_buffered_when_direct_impossible(
    offset: int, address: int, nbytes: int, direct_ok: bool
) -> None:
    parts = plan_parts(offset, address, nbytes, BLOCK, direct_ok)
    assert not any(p.direct for p in parts)
    assert all(p.length <= BLOCK for p in parts)
    assert sum(p.length for p in parts) == nbytes
    assert [p.start for p in parts] == sorted({p.start for p in parts})


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("numel", "start", "aligned"),
    [
        (1 << 18, 0, True),  # everything on the grid: direct
        (1 << 18, 0, False),  # memory off the grid: buffered
        ((1 << 18) + 3, 0, True),  # ragged tail: direct body, buffered tail
        (100_001, 777, True),  # file offset off the grid
        (5, 3, False),  # tiny
    ],
)
def test_round_trip(
    swap_dir: SwapDirectory, dtype: torch.dtype, numel: int, start: int, aligned: bool
) -> None:
    region = swap_dir.file("state").allocate(start + numel + 11, dtype)
    src = aligned_empty(numel, dtype) if aligned else _misaligned(numel, dtype)
    src.copy_(_values(numel, dtype))
    region.write(src, start).wait()
    out = aligned_empty(numel, dtype) if aligned else _misaligned(numel, dtype)
    out.zero_()
    region.read(out, start).wait()
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


def test_unwritten_region_reads_zeros(swap_dir: SwapDirectory) -> None:
    region = swap_dir.file("state").allocate(10_000, torch.float32)
    out = torch.full((10_000,), 7.0)
    region.read(out).wait()
    assert not out.any()


def test_many_concurrent_requests(swap_dir: SwapDirectory, io: AsyncFileIO) -> None:
    file = swap_dir.file("state")
    sizes = [1 + (i * 7919) % 20_000 for i in range(100)]
    regions = [file.allocate(n, torch.float32) for n in sizes]
    values = [_values(n, torch.float32, seed=i) for i, n in enumerate(sizes)]
    writes = [r.write(v) for r, v in zip(regions, values, strict=True)]
    for w in writes:
        w.wait()
    outs = [torch.empty(n) for n in sizes]
    reads = [r.read(o) for r, o in zip(regions, outs, strict=True)]
    for r in reads:
        r.wait()
    assert all(torch.equal(o, v) for o, v in zip(outs, values, strict=True))
    assert io.pending == 0
    assert io.bytes_written == io.bytes_read == 4 * sum(sizes)
    assert io.busy_seconds > 0


def test_chunked_writes_then_whole_read(swap_dir: SwapDirectory) -> None:
    """Unaligned pieces (buffered) written concurrently, read back in one (direct) request,
    and the other way round: the page cache and direct I/O agree."""
    region = swap_dir.file("state").allocate(300_000, torch.float32)
    whole = _values(300_000, torch.float32)
    bounds = [0, 1, 1025, 50_000, 123_457, 300_000]
    pieces = [whole[a:b].clone() for a, b in itertools.pairwise(bounds)]
    futures = [region.write(p, a) for p, a in zip(pieces, bounds, strict=False)]
    for f in futures:
        f.wait()
    out = aligned_empty(300_000, torch.float32)
    region.read(out).wait()
    assert torch.equal(out, whole)

    again = aligned_empty(300_000, torch.float32)
    again.copy_(_values(300_000, torch.float32, seed=5))
    region.write(again).wait()
    for a, b in itertools.pairwise(bounds):
        piece = torch.empty(b - a)
        region.read(piece, a).wait()
        assert torch.equal(piece, again[a:b])


def test_regions_do_not_overlap(swap_dir: SwapDirectory) -> None:
    file = swap_dir.file("state")
    specs = [
        (1, torch.float32),
        (1024, torch.float32),
        (1025, torch.bfloat16),
        (0, torch.float16),
        (5000, torch.float16),
    ]
    regions = [file.allocate(n, d) for n, d in specs]
    assert all(r.offset % ALIGNMENT == 0 for r in regions)
    spans = sorted((r.offset, r.offset + r.nbytes) for r in regions if r.nbytes)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert file.size_bytes == os.path.getsize(file.path) == swap_dir.disk_bytes
    values = [torch.full((r.numel,), float(i + 1), dtype=r.dtype) for i, r in enumerate(regions)]
    for f in [r.write(v) for r, v in zip(regions, values, strict=True)]:
        f.wait()
    for r, v in zip(regions, values, strict=True):
        out = torch.empty_like(v)
        r.read(out).wait()
        assert torch.equal(out, v)


def test_read_through_another_region_of_the_same_bytes(swap_dir: SwapDirectory) -> None:
    file = swap_dir.file("state")
    region = file.allocate(4097, torch.bfloat16)
    src = _values(4097, torch.bfloat16)
    region.write(src).wait()
    raw = SwapRegion(file, region.offset, region.nbytes, torch.uint8)
    out = torch.empty(region.nbytes, dtype=torch.uint8)
    raw.read(out).wait()
    assert torch.equal(out, src.view(torch.uint8))
    # And back: raw bytes written as uint8 read as bf16.
    raw.write(torch.flip(out, [0]).contiguous()).wait()
    back = torch.empty(4097, dtype=torch.bfloat16)
    region.read(back).wait()
    assert torch.equal(back.view(torch.uint8), torch.flip(src.view(torch.uint8), [0]))


def test_storage_stays_resizable(swap_dir: SwapDirectory) -> None:
    """Swapped tensors free and regrow their storage; I/O must not pin it (numpy() would)."""
    region = swap_dir.file("state").allocate(1000, torch.float32)
    t = torch.ones(1000)
    region.write(t).wait()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(4000)
    region.read(t).wait()
    assert torch.equal(t, torch.ones(1000))


def test_zero_size_request_is_done_at_once(swap_dir: SwapDirectory) -> None:
    region = swap_dir.file("state").allocate(0, torch.float32)
    future = region.read(torch.empty(0))
    assert future.done()
    future.wait()


# -- bad requests ------------------------------------------------------------------------------


def test_bounds_and_type_errors(swap_dir: SwapDirectory) -> None:
    region = swap_dir.file("state").allocate(100, torch.float32)
    with pytest.raises(ValueError, match=r"elements \[90, 110\).*100 elements"):
        region.read(torch.empty(20), start=90)
    with pytest.raises(ValueError, match=r"elements \[-1, 9\)"):
        region.write(torch.empty(10), start=-1)
    with pytest.raises(ValueError, match="dtypes must match"):
        region.write(torch.empty(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        region.write(torch.empty(10, 2)[:, 0])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        region.read(torch.empty(10, device="meta"))
    swapped_out = torch.empty(10)
    swapped_out.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="swapped out"):
        region.read(swapped_out)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        swap_dir.file("state").allocate(-1, torch.float32)
    with pytest.raises(ValueError, match="not allowed"):
        swap_dir.file("../escape")


def test_pool_arguments_checked() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        AsyncFileIO(threads=0)
    with pytest.raises(ValueError, match="block_bytes must be >= 4096"):
        AsyncFileIO(block_bytes=100)
    pool = AsyncFileIO(block_bytes=(1 << 20) + 5)
    assert pool.block_bytes == 1 << 20
    pool.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 4097, 1 << 20])
def test_aligned_empty(dtype: torch.dtype, numel: int) -> None:
    t = aligned_empty(numel, dtype, pin=True)  # no CUDA here: plain memory, no error
    assert t.data_ptr() % ALIGNMENT == 0
    assert t.shape == (numel,)
    assert t.dtype == dtype
    t.fill_(1)  # the whole span is writable
    assert aligned_empty(10, dtype, alignment=1 << 16).data_ptr() % (1 << 16) == 0
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, dtype, alignment=3000)


# -- failures surface at wait() ----------------------------------------------------------------


def test_read_past_end_of_truncated_file(swap_dir: SwapDirectory) -> None:
    file = swap_dir.file("state")
    region = file.allocate(50_000, torch.float32)
    region.write(torch.ones(50_000)).wait()
    os.truncate(file.path, 4096)
    future = region.read(torch.empty(50_000))
    with pytest.raises(
        SwapError, match=rf"rank 0: reading \d+ bytes at offset \d+ of {file.path}.*ends before"
    ):
        future.wait()
    assert future.done()
    with pytest.raises(SwapError):  # and again: the failure stays
        future.wait()


def test_os_error_names_file_offset_and_errno(swap_dir: SwapDirectory, tmp_path: Path) -> None:
    file = swap_dir.file("state")
    region = file.allocate(70_000, torch.float32)
    # Swap the descriptors for write-only ones behind the file's back: reads fail with EBADF.
    write_only = os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT)
    for fd in (file.fd, file.direct_fd):
        if fd is not None:
            os.dup2(write_only, fd)
    os.close(write_only)
    future = region.read(aligned_empty(70_000, torch.float32))
    with pytest.raises(SwapError, match=rf"{file.path} failed.*Bad file descriptor") as info:
        future.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EBADF


def test_direct_refused_at_transfer_falls_back(
    swap_dir: SwapDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = swap_dir.file("state")
    if file.direct_fd is None:
        pytest.skip("no O_DIRECT on this filesystem")
    direct_fd = file.direct_fd
    real = os.pwritev

    def refuse_direct(fd: int, buffers: list[memoryview], offset: int) -> int:
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(aio.os, "pwritev", refuse_direct)
    region = file.allocate(1 << 16, torch.float32)
    src = aligned_empty(1 << 16, torch.float32)
    src.copy_(_values(1 << 16, torch.float32))
    region.write(src).wait()
    assert file.direct_fd is None
    out = aligned_empty(1 << 16, torch.float32)
    region.read(out).wait()
    assert torch.equal(out, src)


def test_no_o_direct_at_open_means_buffered(
    tmp_path: Path, io: AsyncFileIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.open

    def tmpfs_like(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, mode)

    monkeypatch.setattr(os, "open", tmpfs_like)
    file = SwapFile(tmp_path / "plain.swp", io)
    monkeypatch.undo()
    assert file.direct_fd is None
    region = file.allocate(1 << 16, torch.float32)
    src = aligned_empty(1 << 16, torch.float32).copy_(torch.arange(1 << 16, dtype=torch.float32))
    region.write(src).wait()
    out = torch.empty(1 << 16)
    region.read(out).wait()
    assert torch.equal(out, src)
    file.close()


def test_allocate_failures(swap_dir: SwapDirectory, monkeypatch: pytest.MonkeyPatch) -> None:
    file = swap_dir.file("state")

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SwapError, match=r"cannot reserve 4\.0 KiB .*No space left"):
        file.allocate(1000, torch.float32)
    assert file.size_bytes == 0

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    region = file.allocate(1000, torch.float32)  # ftruncate instead
    assert os.path.getsize(file.path) == file.size_bytes == 4096
    region.write(torch.ones(1000)).wait()


# -- closing -----------------------------------------------------------------------------------


def test_close_is_idempotent_and_later_use_is_refused(tmp_path: Path) -> None:
    pool = AsyncFileIO(threads=2, block_bytes=BLOCK)
    directory = SwapDirectory(tmp_path, rank=3, io=pool)
    file = directory.file("state")
    region = file.allocate(1 << 18, torch.float32)
    pending = region.write(torch.ones(1 << 18))
    pool.close()  # finishes the queued write
    pool.close()
    assert pending.done()
    pending.wait()
    with pytest.raises(SwapError, match=r"pool was closed"):
        region.read(torch.empty(10))
    file.close()
    file.close()
    with pytest.raises(SwapError, match="was closed"):
        region.read(torch.empty(10))
    with pytest.raises(SwapError, match=r"rank 3: .* was closed"):
        file.allocate(10, torch.float32)
    directory.close()
    directory.close()
    with pytest.raises(SwapError, match="was closed"):
        directory.file("other")


def test_file_closed_with_work_queued(swap_dir: SwapDirectory) -> None:
    file = swap_dir.file("state")
    region = file.allocate(1 << 20, torch.float32)
    futures = [region.write(torch.ones(1 << 20)) for _ in range(4)]
    file.close()  # waits for transfers in progress; queued ones fail at wait()
    failures = []
    for f in futures:
        try:
            f.wait()
        except SwapError as error:
            failures.append(str(error))
    assert all("was closed before this transfer ran" in m for m in failures)


def test_directory_removed_and_nothing_else(tmp_path: Path, io: AsyncFileIO) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text("not ours")
    directory = SwapDirectory(tmp_path, rank=1, io=io)
    assert directory.path.parent == tmp_path
    assert directory.path.name.startswith("zerotrain-swap-")
    assert "-rank1-" in directory.path.name
    for name in ("optimizer", "params"):
        directory.file(name).allocate(1000, torch.float32).write(torch.ones(1000)).wait()
    assert directory.file("optimizer") is directory.file("optimizer")
    assert directory.disk_bytes == 2 * 4096
    directory.close()
    assert not directory.path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "not ours"


def test_foreign_file_in_swap_directory_survives(tmp_path: Path, io: AsyncFileIO) -> None:
    directory = SwapDirectory(tmp_path, rank=0, io=io)
    directory.file("optimizer").allocate(10, torch.float32)
    foreign = directory.path / "someone-elses.bin"
    foreign.write_bytes(b"x")
    directory.close()
    assert foreign.read_bytes() == b"x"
    assert not (directory.path / "optimizer.swp").exists()


def test_exit_handler_removes_unclosed_directory(
    tmp_path: Path, io: AsyncFileIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    handlers: list[Callable[[], None]] = []
    monkeypatch.setattr(atexit, "register", handlers.append)
    monkeypatch.setattr(atexit, "unregister", handlers.remove)
    directory = SwapDirectory(tmp_path, rank=0, io=io)
    directory.file("optimizer").allocate(1000, torch.float32)
    (handler,) = handlers
    monkeypatch.setattr(directory, "_owner_pid", -1)  # as in a forked child: not ours
    handler()
    assert directory.path.exists()
    monkeypatch.setattr(directory, "_owner_pid", os.getpid())
    handler()
    assert not directory.path.exists()
    assert handlers == []  # close() unregistered it
    directory.close()


@pytest.mark.slow  # a fresh interpreter imports torch: seconds
def test_directory_removed_at_exit_if_not_closed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        from zerotrain.offload.aio import AsyncFileIO
        from zerotrain.offload.swap import SwapDirectory
        d = SwapDirectory({str(tmp_path)!r}, 0, AsyncFileIO())
        d.file("optimizer").allocate(1000, torch.float32).write(torch.ones(1000)).wait()
        print(d.path)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    created = Path(done.stdout.strip())
    assert created.parent == tmp_path
    assert not created.exists()
    assert list(tmp_path.iterdir()) == []


# -- check_nvme_path ---------------------------------------------------------------------------

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_check_nvme_path_accepts_and_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvme").mkdir()
    assert check_nvme_path("nvme", 1 << 20, KEY) == tmp_path.resolve() / "nvme"
    assert list((tmp_path / "nvme").iterdir()) == []  # the write probe is gone


def test_check_nvme_path_missing(tmp_path: Path) -> None:
    with pytest.raises(SwapError, match=rf"{KEY} = '.*nope' does not exist; create it"):
        check_nvme_path(tmp_path / "nope", 0, KEY)


def test_check_nvme_path_empty() -> None:
    with pytest.raises(SwapError, match=f"{KEY} is empty"):
        check_nvme_path("", 0, KEY)


def test_check_nvme_path_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SwapError, match=rf"{KEY} = '.*file' is not a directory"):
        check_nvme_path(tmp_path / "file", 0, KEY)


def test_check_nvme_path_not_writable(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.geteuid() == 0 and os.access(locked, os.W_OK):
            # Root with CAP_DAC_OVERRIDE writes through chmod (the /proc case covers root).
            pytest.skip("root writes through chmod")
        with pytest.raises(
            SwapError, match=rf"{KEY} = '.*locked' is not writable: creating a file"
        ):
            check_nvme_path(locked, 0, KEY)
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_check_nvme_path_not_writable_even_for_root() -> None:
    with pytest.raises(SwapError, match=rf"{KEY} = '/proc' is not writable: creating a file"):
        check_nvme_path("/proc", 0, KEY)


def test_check_nvme_path_too_small(tmp_path: Path) -> None:
    with pytest.raises(
        SwapError, match=rf"{KEY} = .* has .* free, but 4096\.0 TiB are needed there for the test"
    ):
        check_nvme_path(tmp_path, 1 << 52, KEY, needed_for="the test")
    with pytest.raises(ValueError, match="needed_bytes must be >= 0"):
        check_nvme_path(tmp_path, -1, KEY)
