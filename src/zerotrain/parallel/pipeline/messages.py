"""What crosses between pipeline stages: tensors, their descriptions, and message tags.

A stage boundary carries a tensor or a tuple of tensors, of any dtype: floating-point ones
get gradients back, integer and bool ones (token ids, masks) cross as themselves and get
none. A receiver must allocate its buffers before the message arrives, so it has to know
the shapes and dtypes: they are described in a small fixed-size int64 message (``encode``)
that is sent only when they may have changed (see ``executor.py``).

Messages between two ranks are matched by tag (``Communicator.post``), so the order in which
two stages post them does not matter: the tag says which channel (activations, gradients,
descriptions), stage, micro-batch and tensor of the boundary a message is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

# The dtypes a stage boundary may carry, by their code in a description message.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
DESCRIPTION_NUMEL = 256  # int64 entries of one description message


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor of a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def gets_gradient(self) -> bool:
        """Floating-point tensors carry gradients back; integer and bool ones do not."""
        return self.dtype.is_floating_point

    def empty(self, device: torch.device) -> torch.Tensor:
        """A buffer to receive this tensor into."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def describe(tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
    """The shapes and dtypes of ``tensors``."""
    return tuple(TensorMeta(tuple(t.shape), t.dtype) for t in tensors)


def signature(tensors: Sequence[torch.Tensor]) -> int:
    """A 62-bit fingerprint of ``tensors``' shapes and dtypes (equal inputs: equal value)."""
    text = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def encode(metas: Sequence[TensorMeta], where: str) -> torch.Tensor:
    """One description message for ``metas``.

    Raises:
        TypeError: a dtype a boundary cannot carry.
        ValueError: more dimensions in all than a message holds.
    """
    values = [len(metas)]
    for meta in metas:
        if meta.dtype not in DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise TypeError(
                f"{where}: a tensor of dtype {meta.dtype} cannot cross stages ({allowed})"
            )
        values += [DTYPES.index(meta.dtype), len(meta.shape), *meta.shape]
    if len(values) > DESCRIPTION_NUMEL:
        raise ValueError(
            f"{where}: {len(metas)} tensors with {len(values)} shape entries in all do not fit "
            f"one description message ({DESCRIPTION_NUMEL}); pass fewer or flatter tensors"
        )
    message = torch.zeros(DESCRIPTION_NUMEL, dtype=torch.int64)
    message[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return message


def encode_or_refuse(
    metas: Sequence[TensorMeta], where: str
) -> tuple[torch.Tensor, Exception | None]:
    """A description message for ``metas``, and the error :func:`encode` raised if it could
    not describe them: then the message says so (a negative count), so that the receiver,
    which waits for it, refuses too instead of waiting out the timeout."""
    try:
        return encode(metas, where), None
    except (TypeError, ValueError) as error:
        refusal = torch.zeros(DESCRIPTION_NUMEL, dtype=torch.int64)
        refusal[0] = -1 - _REFUSALS.index(type(error))
        return refusal, error


_REFUSALS: tuple[type[Exception], ...] = (TypeError, ValueError)


def decode(message: torch.Tensor, where: str = "a stage boundary") -> tuple[TensorMeta, ...]:
    """The inverse of :func:`encode`.

    Raises:
        TypeError / ValueError: the sender could not describe its tensors (its error says
            why; this one names the boundary).
    """
    values = message.tolist()
    if values[0] < 0:
        kind = _REFUSALS[-1 - values[0]]
        raise kind(
            f"{where}: the sending stage could not describe its output to this stage (a "
            "dtype a boundary cannot carry, or more tensors and dimensions than a "
            "description holds); its own error says which"
        )
    count, k, metas = values[0], 1, []
    for _ in range(count):
        dtype, ndim = DTYPES[values[k]], values[k + 1]
        metas.append(TensorMeta(tuple(values[k + 2 : k + 2 + ndim]), dtype))
        k += 2 + ndim
    return tuple(metas)


def as_tensors(value: Any, where: str) -> list[torch.Tensor]:
    """A boundary value as a list of tensors: a tensor, or a tuple or list of tensors.

    Raises:
        TypeError: anything else (named by ``where``: the layer that produced it).
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    kinds = (
        [type(v).__name__ for v in value]
        if isinstance(value, (tuple, list))
        else type(value).__name__
    )
    raise TypeError(
        f"{where} returned {kinds}: what crosses pipeline stages must be a tensor or a tuple "
        "of tensors (any dtype); return other values as tensors, or keep them inside one stage"
    )


def from_tensors(tensors: Sequence[torch.Tensor]) -> Any:
    """What the next stage's first layer is called with: one tensor, or a tuple."""
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


class Channel(IntEnum):
    """What a message carries."""

    ACTIVATIONS = 0
    GRADIENTS = 1
    DESCRIPTION = 2


_SLOT_BITS, _MICRO_BITS, _STAGE_BITS = 5, 13, 10


def tag(channel: Channel, stage: int, microbatch: int, slot: int = 0) -> int:
    """The tag of one message (30 bits: torch takes a signed 32-bit tag).

    ``stage`` is the sending stage for activations and descriptions, the receiving one
    for gradients, so both sides compute the same tag.

    Raises:
        ValueError: a stage, micro-batch or tensor index beyond what a tag holds.
    """
    limits = {"stage": (stage, _STAGE_BITS), "micro-batch": (microbatch, _MICRO_BITS)}
    limits["tensor index"] = (slot, _SLOT_BITS)
    for name, (value, bits) in limits.items():
        if not 0 <= value < 1 << bits:
            raise ValueError(f"pipeline message {name} {value} is outside 0..{(1 << bits) - 1}")
    value = (int(channel) << _STAGE_BITS) | stage
    value = (value << _MICRO_BITS) | microbatch
    return (value << _SLOT_BITS) | slot
