"""Sequence-length curriculum: truncating a batch to the schedule's current length.

DeepSpeed passed the length to the model as ``curriculum_seqlen`` and left the cut to model
code (Megatron's GPT truncated its tokens and labels); a model that ignored the argument
trained at full length without a word. zerotrain cuts the batch itself (and still passes
``curriculum_seqlen`` to a model whose forward takes it): every tensor of the call whose
second dimension is the batch's sequence length is cut there, so inputs, labels, position
ids and padding masks stay aligned; 4-D masks over token pairs (``(batch, heads, S, S)``)
are cut on both token dimensions. A batch no longer than the length is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch


def sequence_length(value: Any) -> int | None:
    """The length of the first tensor with a sequence dimension (``(batch, seq, ...)``)
    found in ``value`` (nested tuples, lists and dicts), or None."""
    if isinstance(value, torch.Tensor):
        return int(value.size(1)) if value.dim() >= 2 else None
    items = value.values() if isinstance(value, dict) else value
    if isinstance(value, (tuple, list, dict)):
        for item in items:
            found = sequence_length(item)
            if found is not None:
                return found
    return None


def truncate(value: Any, seq: int, length: int) -> Any:
    """``value`` with every ``(batch, seq, ...)`` tensor cut to ``length`` tokens."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 4 and value.shape[-1] == seq and value.shape[-2] == seq:
            return value[..., :length, :length]
        if value.dim() >= 2 and value.size(1) == seq:
            return value[:, :length]
        return value
    if isinstance(value, dict):
        return {k: truncate(v, seq, length) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(truncate(v, seq, length) for v in value)
    return value


def truncate_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], length: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A model call's arguments cut to ``length`` tokens (unchanged when not longer)."""
    seq = sequence_length((args, kwargs))
    if seq is None or seq <= length:
        return args, kwargs
    return truncate(args, seq, length), truncate(kwargs, seq, length)
