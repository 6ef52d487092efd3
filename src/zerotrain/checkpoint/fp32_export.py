"""DeepSpeed's ``zero_to_fp32`` functions on zerotrain checkpoints (public module:
``zerotrain.utils.zero_to_fp32``, at DeepSpeed's import path).

DeepSpeed rebuilds fp32 weights from its pickled ``*_optim_states.pt`` partitions; here the
manifest already says where every element of every tensor is, so a tensor is read from the
shard files with :class:`CheckpointReader` (the fp32 master values where the checkpoint has
them), whatever world size and ZeRO stage saved it.

The state dict has the model's ``state_dict()`` keys in its order, the other names of tied
parameters last (as DeepSpeed appends its ``shared_params``; the manifest does not record
where they were), each the same tensor as the name it is tied to; parameters and buffers,
floating-point ones in fp32 and integer ones in their own dtype. Frozen parameters (saved
with ``requires_grad=False``) are left out with ``exclude_frozen_parameters``, and so are
the other names they are tied to.

Files are written with Hugging Face's names and sharding rule (``split_torch_state_dict_
into_shards`` of ``huggingface_hub``, what DeepSpeed calls): tensors in state-dict order, a
new shard when the next tensor would take the current one past ``max_shard_size``, a tensor
larger than that alone in a shard of its own, shards named ``pytorch_model-00001-of-00003.bin``
and listed in ``pytorch_model.bin.index.json`` (``model.safetensors...`` with
``safe_serialization``). A tied tensor is stored once: in a ``.bin`` file under every name
(pickle keeps the sharing, as in DeepSpeed), in a safetensors file under its first name only
(safetensors cannot alias; ``save_pretrained`` drops the tied names the same way and
``from_pretrained`` / ``safetensors.torch.load_model`` tie them again).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import torch

from zerotrain.checkpoint.deepspeed_import import (
    is_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from zerotrain.checkpoint.deepspeed_reader import ImportedReader
from zerotrain.checkpoint.directory import LATEST
from zerotrain.checkpoint.dtype_names import dtype_from_name
from zerotrain.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
)
from zerotrain.checkpoint.manifest import MANIFEST, write_text_atomically
from zerotrain.checkpoint.reader import CheckpointReader
from zerotrain.checkpoint.safetensors_io import StreamingWriter, TensorSpec
from zerotrain.utils.logging import get_logger
from zerotrain.utils.progress import Progress

log = get_logger(__name__)

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
_INDEX_SUFFIX = ".index.json"
# huggingface_hub's parse_size_to_int: decimal units, as DeepSpeed's "5GB" means.
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_DEEPSPEED_FILES = ("*_model_states.pt", "*_optim_states.pt")


def _fp32(name: str) -> torch.dtype:
    """fp32 for a floating-point dtype, else the dtype itself."""
    dtype = dtype_from_name(name)
    return torch.float32 if dtype.is_floating_point else dtype


# ----------------------------------------------------------------------------- reading


def _deepspeed_files(root: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in _DEEPSPEED_FILES:
        found += root.glob(pattern)
        found += root.glob(f"*/{pattern}")
    return sorted(found)


def _looks_like_zerotrain(root: Path) -> bool:
    return (
        (root / MANIFEST).is_file()
        or (root / LATEST).exists()
        or any(root.glob(f"*/{MANIFEST}"))  # a tag, or a .TAG.old copy
        or any(root.glob("rank*.safetensors"))
    )


def open_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> CheckpointReader:
    """The verified checkpoint ``tag`` of ``checkpoint_dir`` (None: the one ``latest`` names;
    ``checkpoint_dir`` may also be one checkpoint). A DeepSpeed checkpoint, or a directory
    that holds no checkpoint at all, is refused with a message saying what it is."""
    root = Path(checkpoint_dir)
    if is_deepspeed_checkpoint(root, tag):
        # DeepSpeed's own layout: its weights, read as engine.load_checkpoint reads them.
        reader: CheckpointReader = ImportedReader(read_deepspeed_checkpoint(root, tag))
        log.info(
            "DeepSpeed checkpoint %s: ZeRO stage %d, %d ranks, step %d",
            reader.path,
            reader.manifest.stage,
            reader.manifest.world_size,
            reader.manifest.global_steps,
        )
        return reader
    try:
        reader = CheckpointReader.open(root, tag)
    except CheckpointError as exc:
        if root.is_dir() and (foreign := _deepspeed_files(root)):
            raise IncompatibleCheckpointError(
                f"{root} holds DeepSpeed files ({foreign[0].relative_to(root)}) but no "
                "checkpoint zerotrain can read: pass the directory DeepSpeed saved into (with "
                "its 'latest'), or one tag directory"
            ) from exc
        nothing = tag is None and root.is_dir() and not _looks_like_zerotrain(root)
        if isinstance(exc, CheckpointNotFoundError) and nothing:
            raise CheckpointNotFoundError(
                f"{root} is not a zerotrain checkpoint directory: it holds no '{LATEST}', no "
                f"{MANIFEST} and no TAG/{MANIFEST}; pass the directory given to "
                "engine.save_checkpoint"
            ) from exc
        raise
    started = time.perf_counter()
    reader.verify()
    log.info(
        "zerotrain checkpoint %s: ZeRO stage %d, %d ranks, step %d (files verified in %.2f s)",
        reader.path,
        reader.manifest.stage,
        reader.manifest.world_size,
        reader.manifest.global_steps,
        time.perf_counter() - started,
    )
    return reader


@dataclass(frozen=True, slots=True)
class _Stored:
    """One stored tensor and every state-dict key that names it (tied ones after the first)."""

    name: str
    keys: tuple[str, ...]
    dtype: torch.dtype  # what it is exported as
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _named(stored: list[_Stored]) -> list[tuple[str, _Stored]]:
    """``(key, stored tensor)`` in state-dict order: first names, then tied ones."""
    return [(item.keys[0], item) for item in stored] + [
        (key, item) for item in stored for key in item.keys[1:]
    ]


def _stored(reader: CheckpointReader, exclude_frozen_parameters: bool) -> list[_Stored]:
    manifest = reader.manifest
    tied: dict[str, list[str]] = {}
    for alias, source in manifest.aliases.items():
        tied.setdefault(source, []).append(alias)
    found = []
    for name, info in manifest.tensors.items():
        if exclude_frozen_parameters and info.kind == "param" and not info.trainable:
            continue
        keys = (name, *tied.get(name, ()))
        found.append(_Stored(name, keys, _fp32(info.dtype), tuple(info.shape)))
    return found


class LazyTensor:
    """A tensor of the checkpoint, read from its files (in fp32) each time
    :meth:`contiguous` is called: the values of ``lazy_mode=True``, as DeepSpeed's
    ``GatheredTensor``. ``shape`` and ``dtype`` need no reading."""

    __slots__ = ("_reader", "dtype", "name", "shape")

    def __init__(self, reader: CheckpointReader, name: str, dtype: torch.dtype) -> None:
        self._reader = reader
        self.name = name
        self.dtype = dtype
        self.shape = torch.Size(reader.manifest.tensors[name].shape)

    def numel(self) -> int:
        """Number of elements."""
        return self.shape.numel()

    def contiguous(self) -> torch.Tensor:
        """The tensor, read now (a new CPU tensor each call)."""
        return self._reader.tensor(self.name, self.dtype)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


@overload
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: Literal[False] = False,
) -> dict[str, torch.Tensor]: ...


@overload
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    *,
    lazy_mode: Literal[True],
) -> dict[str, LazyTensor]: ...


@overload
def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None,
    exclude_frozen_parameters: bool,
    lazy_mode: bool,
) -> dict[str, torch.Tensor] | dict[str, LazyTensor]: ...


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor] | dict[str, LazyTensor]:
    """The model's full state dict from a zerotrain checkpoint, in fp32, on the CPU.

    Args:
        checkpoint_dir: the directory given to ``engine.save_checkpoint`` (the one holding
            ``latest`` and the tag directories), or one checkpoint directory.
        tag: the checkpoint, e.g. ``global_step14``; None: the one ``latest`` names.
        exclude_frozen_parameters: leave out parameters saved with ``requires_grad=False``.
        lazy_mode: return :class:`LazyTensor` values instead, each read when its
            ``.contiguous()`` is called, so a model larger than memory can be walked
            tensor by tensor.

    ``model.load_state_dict(state_dict)`` takes it as it is. Tied parameters appear under
    each name as the same tensor (the same :class:`LazyTensor` in lazy mode).
    """
    reader = open_checkpoint(checkpoint_dir, tag)
    stored = _stored(reader, exclude_frozen_parameters)
    if lazy_mode:
        lazy = {item.name: LazyTensor(reader, item.name, item.dtype) for item in stored}
        return {key: lazy[item.name] for key, item in _named(stored)}
    tensors = {item.name: reader.tensor(item.name, item.dtype) for item in stored}
    state_dict = {key: tensors[item.name] for key, item in _named(stored)}
    log.info(
        "fp32 state dict of %s: %d tensors, %.1f MiB",
        reader.path,
        len(stored),
        sum(item.nbytes for item in stored) / 2**20,
    )
    return state_dict


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it, return it.

    As in DeepSpeed, the state dict is loaded with ``strict=False``; names that do not
    match are logged as a warning, and a checkpoint sharing no name with the model is
    refused. A model still wrapped by an engine must be released first
    (``engine.destroy()``): at stage 3 its parameters are not whole.
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    own = model.state_dict().keys()
    if state_dict and not own & state_dict.keys():
        raise IncompatibleCheckpointError(
            f"no name of the checkpoint's state dict is in the model (checkpoint: "
            f"{sorted(state_dict)[:3]}..., model: {sorted(own)[:3]}...)"
        )
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        log.warning(
            "loaded %s with strict=False: missing from the checkpoint %s, not in the model %s",
            checkpoint_dir,
            result.missing_keys,
            result.unexpected_keys,
        )
    return model


# ----------------------------------------------------------------------------- writing


def parse_shard_size(size: int | str) -> int:
    """Bytes in ``size``: an int or digits, or a number and a decimal unit (``"5GB"`` is
    5 * 10**9; also KB, MB and TB), as ``huggingface_hub.parse_size_to_int`` reads it."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif str(size).strip().isdigit():
        value = int(str(size).strip())
    else:
        text = str(size).strip()
        unit = text[-2:].upper()
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"max_shard_size {size!r}: give bytes, or digits followed by KB, MB, GB or TB "
                "(decimal, as Hugging Face reads them: 5GB is 5 * 10**9 bytes)"
            )
        try:
            value = int(float(text[:-2].strip()) * _SIZE_UNITS[unit])
        except ValueError as exc:
            raise ValueError(f"max_shard_size {size!r}: cannot read the number") from exc
    if value <= 0:
        raise ValueError(f"max_shard_size {size!r} must be positive")
    return value


def plan_shards(sizes: list[int], max_shard_size: int | None) -> list[list[int]]:
    """Indices of ``sizes`` (bytes of each stored tensor, in order) in each shard, by
    ``huggingface_hub.split_state_dict_into_shards_factory``'s rule: a tensor larger than
    ``max_shard_size`` becomes a shard of its own where it is met, the others fill the
    current shard until the next would take it past ``max_shard_size``. None: one shard."""
    if max_shard_size is None:
        return [list(range(len(sizes)))]
    shards: list[list[int]] = []
    current: list[int] = []
    current_size = 0
    for i, size in enumerate(sizes):
        if size > max_shard_size:
            shards.append([i])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(i)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(weights_name: str, count: int) -> list[str]:
    """``pytorch_model.bin`` for one shard, else ``pytorch_model-00001-of-00003.bin``...
    (Hugging Face's names; the same for ``model.safetensors``)."""
    if count == 1:
        return [weights_name]
    stem, ext = weights_name.rsplit(".", 1)
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def _write_bin(reader: CheckpointReader, items: list[_Stored], path: Path) -> None:
    tensors = {item.name: reader.tensor(item.name, item.dtype) for item in items}
    torch.save({key: tensors[item.name] for key, item in _named(items)}, path)


def _write_safetensors(
    reader: CheckpointReader, items: list[_Stored], path: Path, progress: Progress
) -> None:
    specs = [TensorSpec(item.keys[0], item.dtype, item.shape) for item in items]
    writer = StreamingWriter(path, specs, {"format": "pt"})
    try:
        for item, spec in zip(items, specs, strict=True):
            writer.write(spec.name, reader.tensor(item.name, item.dtype))
            progress.update(item.nbytes)
    except BaseException:
        writer.close_quietly()
        raise
    writer.close()


def _stale_outputs(output_dir: Path, weights_name: str, written: set[str]) -> Iterator[Path]:
    """Files of an earlier conversion into ``output_dir`` in the same format that this one
    did not rewrite: a sharded set next to a single file, or shards numbered for another
    count (Hugging Face's ``save_pretrained`` removes them the same way)."""
    stem, ext = weights_name.rsplit(".", 1)
    ours = re.compile(
        rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(ext)}|"
        rf"{re.escape(weights_name)}(?:{re.escape(_INDEX_SUFFIX)})?"
    )
    for path in output_dir.iterdir():
        if path.is_file() and path.name not in written and ours.fullmatch(path.name):
            yield path


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the checkpoint's fp32 state dict into ``output_dir`` as Hugging Face lays a
    model out: ``pytorch_model.bin`` (``torch.save`` of a dict; ``model.safetensors`` with
    ``safe_serialization``), or, when it is larger than ``max_shard_size`` (bytes or a
    string like ``"5GB"``; None: never shard), numbered shards and
    ``pytorch_model.bin.index.json`` / ``model.safetensors.index.json`` with ``metadata``
    (``total_size``) and ``weight_map`` (key -> file).

    Safetensors shards are streamed one tensor at a time; a ``.bin`` shard is built in
    memory (``torch.save`` needs it whole), so memory is about one shard. Each file is
    written under a temporary name and renamed; files of an earlier conversion in the same
    format that this one does not replace are removed afterwards.
    """
    started = time.perf_counter()
    limit = None if max_shard_size is None else parse_shard_size(max_shard_size)
    reader = open_checkpoint(checkpoint_dir, tag)
    stored = _stored(reader, exclude_frozen_parameters)
    weights_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    shards = plan_shards([item.nbytes for item in stored], limit)
    names = shard_names(weights_name, len(shards))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(item.nbytes for item in stored)
    weight_map: dict[str, str] = {}
    with Progress(total, f"writing fp32 weights of {reader.path.name}", unit="B") as progress:
        for indices, name in zip(shards, names, strict=True):
            items = [stored[i] for i in indices]
            target = out / name
            tmp = target.with_name(f".{name}.partial")
            try:
                if safe_serialization:
                    _write_safetensors(reader, items, tmp, progress)
                else:
                    _write_bin(reader, items, tmp)
                    progress.update(sum(item.nbytes for item in items))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, target)
            for key, item in _named(items):
                if not safe_serialization or key == item.keys[0]:
                    weight_map[key] = name
    written = set(names)
    if len(shards) > 1:
        index_name = weights_name + _INDEX_SUFFIX
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomically(out / index_name, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.add(index_name)
    for stale in _stale_outputs(out, weights_name, written):
        log.info("removing %s, left by an earlier conversion", stale)
        stale.unlink()
    log.info(
        "wrote the fp32 weights of %s into %s: %d tensors, %.1f MiB in %d file(s), %.2f s",
        reader.path,
        out,
        len(stored),
        total / 2**20,
        len(shards),
        time.perf_counter() - started,
    )
