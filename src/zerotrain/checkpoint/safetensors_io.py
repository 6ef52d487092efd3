"""Streaming reads and writes of safetensors files, with a CRC-32 computed as bytes go by.

The files are plain safetensors (``safetensors.safe_open`` and ``load_file`` read them).
``safetensors.torch.save_file`` needs every tensor at once and cannot report a checksum, and
``safe_open`` maps whole files into memory; checkpoints need neither: the writer streams
tensors one after another (a consolidated model never has to fit in memory) and the reader
copies a range of elements straight into a destination tensor with ordinary file reads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from zerotrain.checkpoint.errors import CorruptCheckpointError
from zerotrain.utils.raw_bytes import raw_bytes

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_CHUNK_BYTES = 32 << 20  # bounds the staging buffers of conversions and device copies
_MAX_HEADER = 512 << 20


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor in a file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


class StreamingWriter:
    """Writes a safetensors file whose tensors are given up front by name, dtype and shape,
    then streamed in that order with :meth:`write`. ``close()`` fsyncs and returns the file's
    size and CRC-32."""

    def __init__(
        self, path: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        for spec in specs:
            if spec.dtype not in _CODES:
                raise TypeError(f"cannot store {spec.name} of dtype {spec.dtype} in safetensors")
            header[spec.name] = {
                "dtype": _CODES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
        self._specs = list(specs)
        self._next = 0
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._crc = 0
        self._bytes = 0
        self._emit(memoryview(struct.pack("<Q", len(encoded)) + encoded))

    def _emit(self, data: memoryview) -> None:
        self._file.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._bytes += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the data of the next tensor (any device; cast to its declared dtype)."""
        if self._next >= len(self._specs):
            raise ValueError(f"{name}: every declared tensor was already written")
        spec = self._specs[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"expected {spec.name} {list(spec.shape)} next, got {name} {list(tensor.shape)}"
            )
        flat = tensor.detach().reshape(-1)
        step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
        for lo in range(0, flat.numel(), step):
            chunk = flat[lo : lo + step].to("cpu", spec.dtype).contiguous()
            self._emit(raw_bytes(chunk))
        self._next += 1

    def close_quietly(self) -> None:
        """Close without completing (after an error); the file is incomplete. Flushing
        what is buffered may fail again (a full disk): that is not reported twice."""
        with contextlib.suppress(OSError):
            self._file.close()

    def close(self) -> tuple[int, int]:
        """Finish the file (every declared tensor must have been written); returns
        ``(bytes, crc32)``."""
        try:
            if self._next != len(self._specs):
                raise ValueError(
                    f"{self._specs[self._next].name} and later tensors were never written"
                )
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return self._bytes, self._crc


@dataclass(frozen=True, slots=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the data


class SafetensorsReader:
    """Reads ranges of tensors of one safetensors file without mapping it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > min(size - 8, _MAX_HEADER):
                    raise ValueError(f"header length {length} exceeds the file")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise CorruptCheckpointError(
                f"{path}: not a readable safetensors file ({exc})"
            ) from exc
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, _Entry] = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise CorruptCheckpointError(f"{path}: {name} has unknown dtype {info['dtype']}")
            entry = _Entry(dtype, tuple(info["shape"]), 8 + length + begin)
            if (
                end - begin != TensorSpec(name, dtype, entry.shape).nbytes
                or 8 + length + end > size
            ):
                raise CorruptCheckpointError(f"{path}: {name} runs past the end of the file")
            self.entries[name] = entry

    def read_into(self, name: str, lo: int, out: torch.Tensor) -> None:
        """Copy elements ``[lo, lo + out.numel())`` of flattened tensor ``name`` into the
        contiguous tensor ``out`` (converting dtype and device as needed)."""
        entry = self.entries.get(name)
        if entry is None:
            raise CorruptCheckpointError(f"{self.path}: no tensor named {name}")
        numel = math.prod(entry.shape)
        if lo < 0 or lo + out.numel() > numel:
            raise CorruptCheckpointError(
                f"{self.path}: {name} has {numel} elements, asked for [{lo}, {lo + out.numel()})"
            )
        size = entry.dtype.itemsize
        direct = out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous()
        step = out.numel() if direct else max(1, _CHUNK_BYTES // size)
        with open(self.path, "rb", buffering=0) as f:
            for a in range(0, out.numel(), step):
                b = min(out.numel(), a + step)
                target = out[a:b] if direct else torch.empty(b - a, dtype=entry.dtype)
                f.seek(entry.begin + (lo + a) * size)
                view = raw_bytes(target)
                got = 0
                while got < len(view):  # readinto may return short counts
                    n = f.readinto(view[got:])
                    if not n:
                        raise CorruptCheckpointError(f"{self.path}: truncated inside {name}")
                    got += n
                if not direct:
                    out.view(-1)[a:b].copy_(target)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, 0, out.view(-1))
        return out


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file, read in chunks."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK_BYTES)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc
