"""Ulysses for ``transformers`` models: their attention function wrapped, the model unchanged.

transformers models call attention through a registry (``AttentionInterface``) keyed by
``config._attn_implementation``. :func:`wrap_transformers_attention` registers a function
under a new name that exchanges q, k and v over the sequence group (``[b, h, s, d]`` in,
whole sequence with this rank's heads out), runs the model's own implementation (SDPA for
``eager``, which has no causal flag), and exchanges the context back (``[b, s, h, d]``), and
points the model at it. Grouped-query attention: each rank's ``num_key_value_groups`` is
what the head split leaves it (``split_heads``), set on the module for the call.

No attention mask is built for a registered custom function: attention is causal through
the module's ``is_causal``; batches with padding are refused by ``shard_batch`` (they do
not split by position). What else a model's mask would have carried is rebuilt for the
whole sequence or refused by name, never dropped: a sliding window (Mistral, Qwen2's
``use_sliding_window``, Gemma's local layers pass ``sliding_window``) becomes a banded
causal mask; a soft cap on the attention logits (Gemma 2) and masks built from
``token_type_ids`` (prefix spans of PaliGemma and Gemma 3's images) are refused. Feed the
model ``shard_batch``'s output: its ``position_ids`` place the rotary embeddings of each
slice, its ``shift_labels`` and ``num_items_in_batch`` make the model's own loss the
sequence's mean.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence.attention import gather_heads, to_sequence

ATTN_IMPLEMENTATION = "zerotrain_ulysses"
"""The one name registered with ``AttentionInterface``, for every wrapped model."""

# attention module -> (the model's own attention function, its sequence group). Keyed
# weakly: the registry entry is process-wide and permanent, so what it routes through must
# go with the model (an entry per engine holding its communicator kept every dropped
# engine's shared-memory arena alive).
_ROUTES: weakref.WeakKeyDictionary[nn.Module, tuple[Callable[..., Any], Communicator]] = (
    weakref.WeakKeyDictionary()
)


def wrap_transformers_attention(model: nn.Module, comm: Communicator) -> str:
    """Route ``model``'s attention through the sequence group; returns the name registered.

    Raises:
        ValueError: ``model`` is not a transformers model with an attention registry entry.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None:
        raise ValueError(
            f"{type(model).__name__} has no config._attn_implementation: only transformers "
            "models are wrapped this way; give other models an _sp_plan naming their "
            "attention cores"
        )
    _refuse_unsupported_masks(model, config)
    earlier = _ROUTES.get(model)
    if implementation == ATTN_IMPLEMENTATION and earlier is not None:
        local = earlier[0]  # wrapped again (a new engine): the model's own function stays
    else:
        if implementation == "eager" or implementation not in ALL_ATTENTION_FUNCTIONS:
            implementation = "sdpa"  # eager needs a mask for causality; SDPA takes is_causal
        local = ALL_ATTENTION_FUNCTIONS[implementation]
    for module in model.modules():  # the attention modules are among them
        _ROUTES[module] = (local, comm)
    AttentionInterface.register(ATTN_IMPLEMENTATION, _routed)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
    return ATTN_IMPLEMENTATION


# Models whose attention mask holds bidirectional spans from ``token_type_ids`` (image or
# prefix tokens): nothing in the attention call says where they are.
_PREFIX_MASK_MODELS = ("paligemma", "gemma3")


def _refuse_unsupported_masks(model: nn.Module, config: Any) -> None:
    found = []
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        found.append(f"attn_logit_softcapping={cap} (a soft cap on the attention logits)")
    model_type = str(getattr(config, "model_type", ""))
    if model_type in _PREFIX_MASK_MODELS:
        found.append(
            f"model_type={model_type!r} (its mask attends both ways inside prefix/image spans "
            "given by token_type_ids)"
        )
    if found:
        raise ValueError(
            f"sequence_parallel_size > 1 with {type(model).__name__}: "
            + "; ".join(found)
            + ". Ulysses through the transformers attention registry runs causal attention "
            "over the whole sequence and cannot carry that; the model would train on "
            "different attention than it was built with"
        )


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal attention restricted to the last ``window`` positions (transformers' sliding
    window: query i sees keys j with 0 <= i - j < window), as a boolean [1, 1, S, S] mask."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    return ((j <= i) & (i - j < window))[None, None]


def _routed(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    route = _ROUTES.get(module)
    if route is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attention {ATTN_IMPLEMENTATION!r} but belongs to no "
            "model wrapped by wrap_transformers_attention"
        )
    local, comm = route
    if kwargs.get("softcap") is not None:
        raise ValueError(
            f"{type(module).__name__} soft-caps its attention logits (softcap="
            f"{kwargs['softcap']}): Ulysses through the transformers registry cannot carry it"
        )
    # transformers: q, k, v are [b, h, s, d]; the context comes back as [b, s, h, d].
    q, k, v, split, lengths = gather_heads(query, key, value, comm, 1, 2, type(module).__name__)
    mask = None
    window = kwargs.pop("sliding_window", None)
    if window is not None and window < q.shape[2]:  # a shorter sequence sees no difference
        if not getattr(module, "is_causal", True):
            raise ValueError(f"{type(module).__name__}: a sliding window on a non-causal layer")
        mask = _window_mask(q.shape[2], int(window), q.device)
    saved = getattr(module, "num_key_value_groups", None)
    module.num_key_value_groups = split.groups[comm.rank]  # type: ignore[assignment]
    try:
        context, _ = local(module, q, k, v, mask, **kwargs)
    finally:
        if saved is None:
            del module.num_key_value_groups
        else:
            module.num_key_value_groups = saved
    return to_sequence(context, comm, 2, 1, split.query, lengths), None
