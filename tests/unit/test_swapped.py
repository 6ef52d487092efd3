"""Swapped tensors: values survive a trip through the file, views stay valid, memory is
freed only after a write finished, and a write-behind queue keeps at most its limit
resident."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zerotrain.offload.aio import AsyncFileIO
from zerotrain.offload.swap import SwapDirectory, SwapFile
from zerotrain.offload.swapped import SwappedTensor, WriteBehind


@pytest.fixture
def swap_file(tmp_path: Path) -> Iterator[SwapFile]:
    io = AsyncFileIO(threads=2, block_bytes=64 << 10)
    directory = SwapDirectory(tmp_path, rank=0, io=io)
    yield directory.file("t")
    directory.close()
    io.close()


def _swapped(swap_file: SwapFile, values: torch.Tensor, store: bool = True) -> SwappedTensor:
    tensor = values.clone()
    return SwappedTensor(tensor, swap_file.allocate(tensor.numel(), tensor.dtype), store=store)


def test_values_and_views_survive_a_swap(swap_file: SwapFile) -> None:
    values = torch.randn(10_000)
    tensor = values.clone()
    view = tensor[100:200]  # made before the swap, as the optimizer's pieces are
    swapped = SwappedTensor(tensor, swap_file.allocate(tensor.numel(), tensor.dtype))
    assert swapped.resident_bytes == 0
    assert swapped.tensor.untyped_storage().nbytes() == 0
    swapped.materialize()
    assert torch.equal(swapped.tensor, values)
    assert torch.equal(view, values[100:200])
    view.fill_(7.0)
    swapped.write_back()
    swapped.drop()
    assert torch.equal(swapped.materialize()[100:200], torch.full((100,), 7.0))


def test_store_false_reads_back_zeros(swap_file: SwapFile) -> None:
    swapped = _swapped(swap_file, torch.randn(5000), store=False)
    assert torch.equal(swapped.materialize(), torch.zeros(5000))


def test_materialize_without_read_keeps_file_untouched(swap_file: SwapFile) -> None:
    values = torch.randn(5000)
    swapped = _swapped(swap_file, values)
    swapped.materialize(read=False).fill_(1.0)  # memory only: the caller overwrites it
    swapped.drop()  # not written back: the file still holds the old values
    assert torch.equal(swapped.materialize(), values)


def test_started_write_completes_before_memory_is_reused(swap_file: SwapFile) -> None:
    swapped = _swapped(swap_file, torch.zeros(1 << 18))
    swapped.materialize(read=False).fill_(3.0)
    swapped.start_write_back()
    swapped.materialize().fill_(5.0)  # waits for the write of 3s before changing memory
    swapped.drop()
    assert torch.equal(swapped.materialize(), torch.full((1 << 18,), 3.0))


def test_write_behind_bounds_resident_tensors(swap_file: SwapFile) -> None:
    writer = WriteBehind(limit=2)
    tensors = [_swapped(swap_file, torch.zeros(4096), store=False) for _ in range(5)]
    for i, swapped in enumerate(tensors):
        swapped.materialize(read=False).fill_(float(i))
        writer.put(swapped)
        assert sum(t.resident_bytes > 0 for t in tensors) <= 2
    writer.flush()
    assert all(t.resident_bytes == 0 for t in tensors)
    for i, swapped in enumerate(tensors):
        assert torch.equal(swapped.materialize(), torch.full((4096,), float(i)))


def test_write_behind_rewrites_a_pending_tensor(swap_file: SwapFile) -> None:
    writer = WriteBehind(limit=3)
    swapped = _swapped(swap_file, torch.zeros(4096), store=False)
    swapped.materialize(read=False).fill_(1.0)
    writer.put(swapped)
    swapped.materialize().add_(1.0)  # still resident: accumulate into it
    writer.put(swapped)  # queued once, written again
    writer.flush()
    assert swapped.resident_bytes == 0
    assert torch.equal(swapped.materialize(), torch.full((4096,), 2.0))


def test_write_behind_needs_room() -> None:
    with pytest.raises(Exception, match="room"):
        WriteBehind(limit=0)
