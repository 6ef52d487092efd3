"""Put ``SparseSelfAttention`` into a model: the demo GPT here, ``transformers`` models in hf.py.

``apply_sparse_attention`` is what ``initialize`` calls for a config with a ``sparse_attention``
section: a model that already holds ``SparseSelfAttention`` modules (built by the user from the
section, as DeepSpeed users did) is left as it is; the demo GPT and ``transformers`` models that
route attention through the attention interface get it swapped in; any other model is an error
that says how to wire it, so the section is never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from zerotrain.examples.gpt import GPT, CausalCore, CausalSelfAttention
from zerotrain.sparse_attention.attention import SparseSelfAttention
from zerotrain.sparse_attention.from_config import resolve_sparsity
from zerotrain.sparse_attention.sparsity_config import SparsityConfig
from zerotrain.utils.logging import get_logger

_log = get_logger(__name__)


class SparseCausalCore(nn.Module):
    """The demo GPT's attention core (``q, k, v -> out`` on ``(B, H, T, D)``), block-sparse."""

    def __init__(self, attention: SparseSelfAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(q, k, v)


def sparse_attention_for_gpt(
    model: GPT,
    sparsity: SparsityConfig | Mapping[str, Any],
    *,
    max_seq_length: int | None = None,
    kernel: str | None = None,
) -> GPT:
    """Replace the attention core of every block of the demo GPT, in place.

    The GPT is causal, so the attention is causal whatever the layout's ``attention`` says
    (a bidirectional layout loses its blocks above the diagonal, and is logged).

    Args:
        model: a :class:`zerotrain.examples.gpt.GPT`.
        sparsity: a layout class built for ``n_head`` heads, or a ``sparse_attention``
            section (DeepSpeed keys).
        max_seq_length: longest sequence (default: the section's ``max_seq_length``, else the
            model's ``block_size``).
        kernel: ``"auto"``, ``"blocked"`` or ``"flex"`` (default: the section's, else auto).

    Returns:
        ``model``.

    Raises:
        ValueError: attention dropout is configured (the sparse kernel has none), or the
            layout's head count is not the model's.
    """
    cfg = model.cfg
    config, kernel_name = resolve_sparsity(sparsity, cfg.n_head, kernel)
    section_length = (
        None if isinstance(sparsity, SparsityConfig) else sparsity.get("max_seq_length")
    )
    if config.num_heads != cfg.n_head:
        raise ValueError(
            f"sparsity config has num_heads={config.num_heads}; the model has {cfg.n_head}"
        )
    if config.attention == "bidirectional":
        _log.info(
            "sparse attention: bidirectional layout in a causal model; blocks above the "
            "diagonal are not computed"
        )
    cores = [cast(CausalSelfAttention, b.attn) for b in model.blocks]
    for attn in cores:
        core = attn.core
        if isinstance(core, CausalCore) and core.dropout > 0:
            raise ValueError(
                f"sparse attention has no attention dropout; the model has {core.dropout} "
                "(set GPTConfig.attn_dropout=0)"
            )
    attention = SparseSelfAttention(
        config,
        max_seq_length=max_seq_length or section_length or cfg.block_size,
        causal=True,
        kernel=kernel_name,
    )
    # One module for every layer: the layout is the same, and its buffer is built once.
    for attn in cores:
        attn.register_module("core", SparseCausalCore(attention))
    return model


def has_sparse_attention(model: nn.Module) -> bool:
    """Whether ``model`` already holds a ``SparseSelfAttention`` module."""
    return any(isinstance(m, SparseSelfAttention) for m in model.modules())


def apply_sparse_attention(model: nn.Module, section: Mapping[str, Any]) -> str:
    """Make ``model`` use the ``sparse_attention`` section; returns what was done, for the log.

    Raises:
        ValueError: the model has no sparse attention and is not one zerotrain can swap it
            into; or the section is invalid for it.
    """
    if has_sparse_attention(model):
        count = sum(isinstance(m, SparseSelfAttention) for m in model.modules())
        return f"the model's own {count} SparseSelfAttention module(s) are used as built"
    if isinstance(model, GPT):
        sparse_attention_for_gpt(model, section)
        return f"swapped into the {len(model.blocks)} blocks of the demo GPT"
    from zerotrain.sparse_attention import hf

    if hf.is_supported(model):
        hf.sparse_attention_for_hf(model, section)
        return f"swapped into {type(model).__name__} through the transformers attention interface"
    raise ValueError(
        f"sparse_attention is set but {type(model).__name__} has no SparseSelfAttention module "
        "and is not a model zerotrain can swap it into (the demo GPT, transformers models that "
        "use the attention interface); build your attention with zerotrain.sparse_attention."
        "SparseSelfAttention(sparsity_config_from_dict(config['sparse_attention'], num_heads)) "
        "or remove the section"
    )
