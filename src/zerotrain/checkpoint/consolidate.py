"""A full state dict from a sharded checkpoint: in memory, or streamed to one safetensors file.

Streaming holds one tensor at a time (plus a bounded conversion buffer), so consolidating a
model needs memory for its largest tensor, not for the model. Parameters take their fp32
master values where the checkpoint has them; tied parameters appear under every name the
model's ``state_dict()`` uses, so ``model.load_state_dict(safetensors.torch.load_file(out))``
works as it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from zerotrain.checkpoint.dtype_names import dtype_from_name
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.checkpoint.safetensors_io import StreamingWriter, TensorSpec
from zerotrain.utils.logging import get_logger
from zerotrain.utils.progress import Progress

log = get_logger(__name__)


def _target_dtype(stored: str, dtype: torch.dtype | None) -> torch.dtype:
    """The model's own dtype, or ``dtype`` for floating-point tensors when one is asked."""
    own = dtype_from_name(stored)
    return dtype if dtype is not None and own.is_floating_point else own


def _entries(reader: CheckpointReader) -> list[tuple[str, str]]:
    """``(state-dict key, stored name)`` in state-dict order, aliases after their source."""
    entries = []
    aliases_of: dict[str, list[str]] = {}
    for alias, source in reader.manifest.aliases.items():
        aliases_of.setdefault(source, []).append(alias)
    for name in reader.manifest.tensors:
        entries.append((name, name))
        entries += [(alias, name) for alias in aliases_of.get(name, [])]
    return entries


def iter_state_dict(
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` of the model's full state dict, one tensor at a time."""
    reader = CheckpointReader.open(load_dir, tag)
    if verify:
        reader.verify()
    for key, name in _entries(reader):
        info = reader.manifest.tensors[name]
        yield key, reader.tensor(name, _target_dtype(info.dtype, dtype))


def load_state_dict_from_checkpoint(
    load_dir: str | os.PathLike[str], tag: str | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's full state dict (parameters with their fp32 master values where saved,
    buffers), in the model's own dtypes unless ``dtype`` is given, on the CPU."""
    return dict(iter_state_dict(load_dir, tag, dtype))


def consolidate(
    load_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    tag: str | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Write the model's full state dict to the safetensors file ``out``, one tensor at a
    time (written to ``out``'s directory first, then renamed); returns its size in bytes."""
    started = time.perf_counter()
    reader = CheckpointReader.open(load_dir, tag)
    reader.verify()
    entries = _entries(reader)
    specs = []
    for key, name in entries:
        info = reader.manifest.tensors[name]
        specs.append(TensorSpec(key, _target_dtype(info.dtype, dtype), tuple(info.shape)))
    target = Path(out)
    tmp = target.with_name(f".{target.name}.partial")
    writer = StreamingWriter(tmp, specs, {"format": "pt"})
    total = sum(spec.nbytes for spec in specs)
    try:
        with Progress(total, f"consolidating {reader.path.name}", unit="B") as progress:
            for (key, name), spec in zip(entries, specs, strict=True):
                tensor = reader.tensor(name, spec.dtype)
                writer.write(key, tensor)
                progress.update(tensor.numel() * tensor.element_size())
    except BaseException:
        writer.close_quietly()
        tmp.unlink(missing_ok=True)
        raise
    size, _ = writer.close()
    os.replace(tmp, target)
    log.info(
        "consolidated %s into %s: %d tensors, %.1f MiB in %.2f s",
        reader.path,
        target,
        len(entries),
        size / 2**20,
        time.perf_counter() - started,
    )
    return size
