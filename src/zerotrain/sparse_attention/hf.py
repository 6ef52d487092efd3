"""``SparseSelfAttention`` in Hugging Face ``transformers`` models, through the attention interface.

DeepSpeed's ``SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention``
replaced the self-attention modules of BERT and RoBERTa only. Here the swap goes through
``transformers``' own extension points, so it covers every model whose attention layers call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` (BERT, RoBERTa,
GPT-2, Llama and most recent architectures), without touching their modules or weights:

* an attention function named :data:`ATTN_IMPLEMENTATION` is registered with
  ``AttentionInterface``, and ``sdpa_mask`` under the same name with ``AttentionMaskInterface``,
  so the function receives the model's mask as a boolean ``(B, 1, L, L)`` keep-mask (or None
  where there is no padding: the layout's direction then supplies the causality); a mask that
  is only padding reaches the kernel as a ``(B, L)`` key mask, not as a dense ``L x L`` bias;
* the model is switched to it with ``model.set_attn_implementation``;
* the ``SparseSelfAttention`` (one, shared by every layer: the layout is the same) is found
  from the calling attention module through a weak side table; nothing is set on the modules.

Limits, each refused with a ``ValueError`` that says so: models with cross-attention or
sub-configs (encoder-decoder, multimodal), attention dropout while training (the sparse kernel
has none), a layout whose direction is not the model's (a decoder needs
``attention="unidirectional"``, an encoder ``"bidirectional"``; ``DenseSparsityConfig``, which
has no direction, is accepted for both), incremental decoding with a KV cache (query and key
lengths differ), softcapping and attention sinks. Position embeddings are not extended (see
:func:`replace_model_self_attention_with_sparse_self_attention`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch
from torch import nn

from zerotrain.sparse_attention.attention import SparseSelfAttention
from zerotrain.sparse_attention.from_config import resolve_sparsity
from zerotrain.sparse_attention.sparsity_config import DenseSparsityConfig, SparsityConfig
from zerotrain.utils.logging import get_logger

_log = get_logger(__name__)

ATTN_IMPLEMENTATION = "zerotrain_block_sparse"
"""The name the sparse attention is registered under in ``transformers``."""

DEFAULT_MAX_SEQ_LENGTH_CAP = 8192
"""Most tokens the default ``max_seq_length`` allows (the layout grows with its square)."""

_SUPPORTED = (
    "transformers models whose attention layers go through the attention interface (BERT, "
    "RoBERTa, GPT-2, Llama, ...: those that accept model.set_attn_implementation(...)), "
    "self-attention only (no cross-attention, encoder-decoder or multimodal sub-configs)"
)

# Config keys of attention dropout (BERT/RoBERTa, GPT-2, Llama-style).
_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")

# Learned absolute position tables, by attribute name (BERT/RoBERTa, GPT-2, OPT-style).
_POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions")

ModelT = TypeVar("ModelT", bound=nn.Module)

# Every module of a swapped model -> the SparseSelfAttention its attention calls use.
_SPARSE: weakref.WeakKeyDictionary[nn.Module, SparseSelfAttention] = weakref.WeakKeyDictionary()


def _unsupported_reason(model: nn.Module) -> str | None:
    # Why ``model`` cannot take the swap, or None when it can.
    try:
        import transformers
        from transformers import PreTrainedModel
    except ImportError:
        return "transformers is not installed"
    try:
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
        from transformers.modeling_utils import AttentionInterface  # noqa: F401
    except ImportError:
        return (
            f"transformers {transformers.__version__} has no AttentionInterface / "
            "AttentionMaskInterface; upgrade transformers"
        )
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    if not hasattr(model, "set_attn_implementation"):
        return (
            f"transformers {transformers.__version__} has no "
            "PreTrainedModel.set_attn_implementation; upgrade transformers"
        )
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and not type(sub)._can_set_attn_implementation():
            return (
                f"{type(sub).__name__} does not route its attention through the "
                "transformers attention interface"
            )
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(
        config, "add_cross_attention", False
    ):
        return "it has cross-attention layers (SparseSelfAttention is self-attention only)"
    if getattr(config, "sub_configs", None):
        return (
            f"its config has sub-configs ({', '.join(sorted(config.sub_configs))}): "
            "multimodal and composite models are not supported"
        )
    if not isinstance(getattr(config, "num_attention_heads", None), int):
        return "its config has no num_attention_heads"
    return None


def is_supported(model: nn.Module) -> bool:
    """Whether :func:`sparse_attention_for_hf` can swap sparse attention into ``model``.

    Args:
        model: any module; False (never an error) when ``transformers`` is not installed.

    Returns:
        True for a ``transformers`` model whose attention goes through the attention interface
        and that has no cross-attention or sub-configs.
    """
    return _unsupported_reason(model) is None


def sparse_attention_of(model: nn.Module) -> SparseSelfAttention | None:
    """The ``SparseSelfAttention`` a swapped model (or any module of one) attends with.

    Args:
        model: a model passed to :func:`sparse_attention_for_hf`, or one of its modules.

    Returns:
        The shared module, or None when ``model`` was not swapped.
    """
    return _SPARSE.get(model)


def _register() -> None:
    # Idempotent: the interfaces are class-wide mappings.
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sparse_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _model_is_causal(model: nn.Module) -> bool | None:
    # From the attention modules' ``is_causal`` (what sdpa_attention_forward reads); None
    # when no module says, and an error when they disagree.
    flags = [getattr(m, "is_causal", None) for m in model.modules()]
    found = {flag for flag in flags if isinstance(flag, bool)}
    if len(found) > 1:
        raise ValueError(
            f"{type(model).__name__} has both causal and bidirectional attention layers; one "
            "sparsity layout cannot serve both"
        )
    return found.pop() if found else None


def _position_limit(model: nn.Module) -> int | None:
    # Tokens a learned absolute position table covers (RoBERTa's starts after padding_idx);
    # None for rotary, ALiBi or relative positions, which have no hard limit.
    table_size = getattr(model.config, "max_position_embeddings", None)
    for name, sub in model.named_modules():
        if (
            isinstance(sub, nn.Embedding)
            and name.rsplit(".", 1)[-1] in _POSITION_TABLES
            and sub.num_embeddings == table_size
        ):
            offset = 0 if sub.padding_idx is None else sub.padding_idx + 1
            return sub.num_embeddings - offset
    return None


def sparse_attention_for_hf(
    model: ModelT,
    sparsity: SparsityConfig | Mapping[str, Any],
    *,
    max_seq_length: int | None = None,
    kernel: str | None = None,
) -> ModelT:
    """Make a ``transformers`` model attend through ``SparseSelfAttention``, in place.

    The weights and modules are untouched; the model's attention implementation becomes
    :data:`ATTN_IMPLEMENTATION` (``model.set_attn_implementation("sdpa")`` goes back to dense).
    Every layer shares one ``SparseSelfAttention``. Padding and other masks the model builds
    are applied on top of the layout; the layout's ``"unidirectional"`` direction supplies
    causality. Sequences longer than ``max_seq_length`` are refused at the forward.

    Args:
        model: a ``transformers`` model (see :func:`is_supported`).
        sparsity: a layout class built for the model's ``num_attention_heads``, or a
            ``sparse_attention`` section (DeepSpeed keys, plus ``seed`` and ``kernel``).
        max_seq_length: the longest sequence; the layout is built for it and shorter ones use
            its top-left corner. Default: the model's ``max_position_embeddings`` (less
            RoBERTa's padding offset), at most :data:`DEFAULT_MAX_SEQ_LENGTH_CAP`.
        kernel: ``"auto"``, ``"blocked"`` or ``"flex"`` (default: the section's, else auto).

    Returns:
        ``model``.

    Raises:
        ValueError: an unsupported model (named, with what is supported); a layout whose head
            count or direction is not the model's; a ``max_seq_length`` beyond the model's
            learned position table; an invalid section, kernel or length.
    """
    reason = _unsupported_reason(model)
    if reason is not None:
        raise ValueError(
            f"cannot swap sparse attention into {type(model).__name__}: {reason}. "
            f"Supported: {_SUPPORTED}"
        )
    config: Any = cast(Any, model).config
    heads = int(config.num_attention_heads)
    layout, kernel_name = resolve_sparsity(sparsity, heads, kernel)
    if layout.num_heads != heads:
        raise ValueError(
            f"the sparsity config has num_heads={layout.num_heads} but "
            f"{type(model).__name__} has num_attention_heads={heads}"
        )
    model_causal = _model_is_causal(model)
    causal = layout.attention == "unidirectional"
    if isinstance(layout, DenseSparsityConfig) and model_causal is not None:
        causal = model_causal  # dense has no direction to disagree with
    elif model_causal is not None and causal != model_causal:
        kind = "causal decoder" if model_causal else "bidirectional encoder"
        want = "unidirectional" if model_causal else "bidirectional"
        raise ValueError(
            f"{type(model).__name__} is a {kind} but the sparsity config has "
            f"attention={layout.attention!r}; build it with attention={want!r}"
        )
    limit = _position_limit(model)
    if max_seq_length is None and isinstance(sparsity, Mapping):
        max_seq_length = sparsity.get("max_seq_length")  # the section's (zerotrain key)
    if max_seq_length is None:
        known = limit if limit is not None else getattr(config, "max_position_embeddings", None)
        max_seq_length = min(int(known or 2048), DEFAULT_MAX_SEQ_LENGTH_CAP)
    elif limit is not None and max_seq_length > limit:
        raise ValueError(
            f"max_seq_length={max_seq_length} is more than the {limit} positions of "
            f"{type(model).__name__}'s learned position embeddings (max_position_embeddings="
            f"{config.max_position_embeddings}); position embeddings are not extended: "
            "extend them and config.max_position_embeddings first"
        )
    attention = SparseSelfAttention(
        layout,
        attn_mask_mode="add",  # bool masks keep where True; float masks are additive (HF's)
        max_seq_length=max_seq_length,
        causal=causal,
        kernel=kernel_name,
    )
    dropout = {k: getattr(config, k) for k in _DROPOUT_KEYS if getattr(config, k, 0) or 0}
    if dropout:
        _log.warning(
            "sparse attention in %s: attention dropout %s is configured but the sparse kernel "
            "has none; a forward in training mode will raise (set it to 0 to train)",
            type(model).__name__,
            ", ".join(f"{k}={v}" for k, v in dropout.items()),
        )
    _register()
    for sub in model.modules():
        _SPARSE[sub] = attention
    cast(Any, model).set_attn_implementation(ATTN_IMPLEMENTATION)
    _log.info(
        "sparse attention in %s: %s, %s, max_seq_length %d, kernel %s",
        type(model).__name__,
        type(layout).__name__,
        "causal" if causal else "bidirectional",
        max_seq_length,
        kernel_name,
    )
    return model


def replace_model_self_attention_with_sparse_self_attention(
    model: ModelT, max_position: int, sparsity_config: SparsityConfig
) -> ModelT:
    """DeepSpeed's ``SparseAttentionUtils`` entry point, for any supported ``transformers`` model.

    DeepSpeed covered BERT and RoBERTa and set ``config.max_position_embeddings`` to
    ``max_position`` (RoBERTa: ``+ 2``), expecting ``extend_position_embedding`` to have been
    called first. Here the config is left as it is and position embeddings are not extended:
    ``max_position`` is the longest sequence the layout is built for, and one beyond a learned
    position table is an error.

    Args:
        model: a ``transformers`` model (see :func:`is_supported`).
        max_position: the longest sequence the model will see.
        sparsity_config: a layout class built for the model's ``num_attention_heads``.

    Returns:
        ``model``, attending through ``SparseSelfAttention``.

    Raises:
        ValueError: as :func:`sparse_attention_for_hf`.
    """
    return sparse_attention_for_hf(model, sparsity_config, max_seq_length=max_position)


def _key_padding(mask: torch.Tensor, causal: bool, batch: int) -> torch.Tensor | None:
    # A (b, 1, L, L) bool mask that is only key padding (on top of causality) as a (B, L)
    # key mask: far cheaper in the kernel than a dense L x L bias. None when it is more.
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    keys = mask[:, 0, -1, :]  # the last query sees every kept key, causal or not
    expected = keys[:, None, None, :]
    if causal:
        length = mask.shape[-1]
        below = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
        expected = expected & below
    if not torch.equal(mask, expected.expand(mask.shape)):
        return None
    return keys.expand(batch, -1)


def sparse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`ATTN_IMPLEMENTATION` (HF's signature).

    Args:
        module: the calling attention module, of a model swapped by
            :func:`sparse_attention_for_hf`.
        query: ``(B, H, L, D)``.
        key, value: ``(B, H_kv, L, D)``; ``H_kv`` divides ``H`` (grouped-query attention).
        attention_mask: a bool keep-mask or an additive float mask, ``(1|B, 1|H, L, L)``, or
            None.
        dropout: attention dropout; must be 0.
        scaling: factor on ``q . k`` (default ``D ** -0.5``).
        is_causal: overrides ``module.is_causal``; must match the layout's direction.
        position_bias: added to the scores (T5-style relative positions), differentiated.
        kwargs: other ``transformers`` arguments; ``softcap`` and ``s_aux`` are refused.

    Returns:
        ``(B, L, H, D)`` output and None (no attention weights).

    Raises:
        ValueError: a module of no swapped model, dropout, unequal query and key lengths (KV
            cache decoding, cross-attention), a direction other than the layout's, softcap,
            attention sinks or an unusable mask.
    """
    name = type(module).__name__
    attention = _SPARSE.get(module)
    if attention is None:
        raise ValueError(
            f"{name} uses attn_implementation={ATTN_IMPLEMENTATION!r} but belongs to no model "
            "passed to zerotrain.sparse_attention.hf.sparse_attention_for_hf (a copy made "
            "after the swap?); call it on this model"
        )
    if dropout > 0:
        raise ValueError(
            f"{name} asks for attention dropout {dropout} but SparseSelfAttention has no "
            "dropout: set the model's attention dropout to 0 (attention_probs_dropout_prob, "
            "attn_pdrop or attention_dropout in its config) or call model.eval()"
        )
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{name}: SparseSelfAttention does not support {unsupported}")
    batch, heads, length, dim = query.shape
    if key.shape[2] != length:
        raise ValueError(
            f"{name}: {length} queries but {key.shape[2]} keys; SparseSelfAttention attends a "
            "whole sequence to itself (no KV-cache decoding: pass use_cache=False and run "
            "the full sequence; no cross-attention)"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if bool(causal) != attention.causal:
        raise ValueError(
            f"{name} attends {'causally' if causal else 'bidirectionally'} but the sparse "
            f"attention was built {'causal' if attention.causal else 'bidirectional'}"
        )
    kv_heads = key.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"{name}: {heads} query heads are not a multiple of {kv_heads}")
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    default_scale = dim**-0.5
    if scaling is not None and not math.isclose(scaling, default_scale, rel_tol=1e-12):
        query = query * (scaling / default_scale)
    key_padding = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"{name}: attention mask of type {type(attention_mask).__name__} is not "
                "supported (a bool or additive float tensor is)"
            )
        key_padding = _key_padding(attention_mask, attention.causal, batch)
        if key_padding is not None:
            attention_mask = None
    out = attention(
        query,
        key,
        value,
        rpe=position_bias,
        key_padding_mask=key_padding,
        attn_mask=attention_mask,
    )
    return out.transpose(1, 2).contiguous(), None
