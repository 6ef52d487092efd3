"""An English text corpus that needs no download: the documentation shipped with Python.

``pydoc_data.topics`` holds the reference-manual text behind ``help()`` (about 460 KB of
prose and examples); it is part of the standard library on every CPython installation.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def load_corpus() -> bytes:
    """The corpus as UTF-8 bytes (deterministic: topics in sorted order)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed-length windows of a byte string: input ``x`` and next-byte targets ``y``.

    Args:
        data: the bytes.
        block_size: tokens per sample.
        stride: distance between window starts (``block_size`` = no overlap).
    """

    def __init__(self, data: bytes, block_size: int, stride: int | None = None) -> None:
        if len(data) <= block_size:
            raise ValueError(f"{len(data)} bytes are too few for windows of {block_size}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size
        self.stride = stride or block_size
        self._count = (len(self.tokens) - block_size - 1) // self.stride + 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._count:
            raise IndexError(index)
        start = index * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def split(data: bytes, holdout: float = 0.05) -> tuple[bytes, bytes]:
    """Train / validation split at a fixed point (the tail is held out)."""
    cut = int(len(data) * (1 - holdout))
    return data[:cut], data[cut:]
