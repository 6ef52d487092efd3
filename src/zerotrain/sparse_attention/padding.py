"""Pad a model's inputs to a multiple of the sparse block, and cut the output back.

``SparseSelfAttention`` pads internally, so these are only needed by code that wants the whole
model to run at a block multiple (DeepSpeed's BERT recipe did, because its kernel required it).
The padded tokens are masked out of attention through ``attention_mask``; slicing them off the
output leaves them with zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pad_to_block_size(
    block_size: int,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    pad_token_id: int,
    model_embeddings: nn.Module | None = None,
) -> tuple[
    int,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """Pad the sequence dimension of every given input to a multiple of ``block_size``.

    Same arguments and results as DeepSpeed's ``SparseAttentionUtils.pad_to_block_size``, except
    that an ``attention_mask`` of ``None`` becomes an explicit mask (ones, then zeros for the
    padding) instead of raising, since the padding must be masked.

    Args:
        block_size: the sparsity config's block.
        input_ids: ``(B, L)`` token ids, or None.
        attention_mask: ``(B, L)``, 1 for real tokens, or None.
        token_type_ids: ``(B, L)``, padded with 0, or None.
        position_ids: ``(B, L)``, padded with ``pad_token_id`` as DeepSpeed did, or None.
        inputs_embeds: ``(B, L, E)``, padded with the embeddings of ``pad_token_id``, or None.
        pad_token_id: the padding token.
        model_embeddings: embeds the padding tokens when ``inputs_embeds`` is given.

    Returns:
        ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)``.

    Raises:
        ValueError: neither ``input_ids`` nor ``inputs_embeds`` given, or ``inputs_embeds``
            needs padding without ``model_embeddings``.
    """
    if input_ids is not None:
        batch, seq_len = input_ids.shape
        device = input_ids.device
    elif inputs_embeds is not None:
        batch, seq_len = inputs_embeds.shape[:2]
        device = inputs_embeds.device
    else:
        raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
    pad_len = (block_size - seq_len % block_size) % block_size
    if pad_len == 0:
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
    if inputs_embeds is not None:
        if model_embeddings is None:
            raise ValueError(
                "pad_to_block_size: inputs_embeds must be padded with the padding token's "
                "embedding; pass model_embeddings"
            )
        pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=device)
        inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
    if input_ids is not None:
        input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
    if position_ids is not None:
        position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
    if attention_mask is None:
        attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
    if token_type_ids is not None:
        token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
    return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
    """Drop the last ``pad_len`` positions of ``(B, L, ...)`` output (a no-op for 0)."""
    return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output
