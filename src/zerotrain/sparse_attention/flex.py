"""FlexAttention with a block mask built from a sparsity layout, where FlexAttention runs.

On torch 2.13 FlexAttention trains on CUDA and runs forward only on CPU (compiled); the pure
torch kernel in ``blocked.py`` covers CPU training. The same :class:`BlockTable` drives both, so
they attend to exactly the same positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zerotrain.sparse_attention.blocked import BlockTable, Extras


def flex_available() -> bool:
    """Whether this torch has FlexAttention."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    # One compiled entry point per process; torch.compile caches the graphs per shape itself.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BlockTable,
    extras: Extras,
    *,
    scale: float,
    causal: bool,
    length: int,
) -> torch.Tensor:
    """The attention of :func:`~zerotrain.sparse_attention.blocked.block_sparse_attention`,
    computed by compiled FlexAttention.

    Raises:
        RuntimeError: gradients are needed on a CPU tensor (FlexAttention's CPU kernel has no
            backward in this torch; use ``kernel="blocked"``).
    """
    from torch.nn.attention.flex_attention import BlockMask

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, extras.rpe)
    )
    if needs_grad and q.device.type == "cpu":
        raise RuntimeError(
            "sparse attention kernel 'flex' cannot train on CPU: FlexAttention's CPU kernel is "
            "forward only in this torch; use kernel='blocked' (or 'auto')"
        )
    bs = table.block
    nb = table.num_blocks
    counts = table.valid.sum(-1).to(torch.int32)
    indices = torch.zeros(table.num_heads, nb, nb, dtype=torch.int32, device=q.device)
    indices[..., : table.width] = table.cols.to(torch.int32)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = kv_idx < length
        if causal:
            keep = keep & (kv_idx <= q_idx)
        return keep

    key_bias, dense_bias, rpe = extras.key_bias, extras.dense_bias, extras.rpe
    single_head = {
        name: t is not None and t.shape[1] == 1 for name, t in (("d", dense_bias), ("r", rpe))
    }
    single_batch = {
        name: t is not None and t.shape[0] == 1 for name, t in (("d", dense_bias), ("r", rpe))
    }

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if key_bias is not None:
            score = score + key_bias[b, kv_idx]
        if dense_bias is not None:
            bi = 0 if single_batch["d"] else b
            hi = 0 if single_head["d"] else h
            term = dense_bias[bi, hi, q_idx, kv_idx]
            if dense_bias.dtype == torch.bool:
                score = torch.where(term, score, float("-inf"))
            else:
                score = score + term
        if rpe is not None:
            bi = 0 if single_batch["r"] else b
            hi = 0 if single_head["r"] else h
            score = score + rpe[bi, hi, q_idx, kv_idx]
        return score

    block_mask = BlockMask.from_kv_blocks(
        counts.unsqueeze(0).to(q.device),
        indices.unsqueeze(0),
        BLOCK_SIZE=bs,
        mask_mod=mask_mod,
        seq_lengths=(q.shape[2], k.shape[2]),
    )
    plain = key_bias is None and dense_bias is None and rpe is None
    out = _compiled_flex()(
        q, k, v, score_mod=None if plain else score_mod, block_mask=block_mask, scale=scale
    )
    return out
