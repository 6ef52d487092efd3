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
not split by position). Feed the model ``shard_batch``'s output: its ``position_ids`` place
the rotary embeddings of each slice, its ``shift_labels`` and ``num_items_in_batch`` make
the model's own loss the sequence's mean.
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
    # transformers: q, k, v are [b, h, s, d]; the context comes back as [b, s, h, d].
    q, k, v, split, lengths = gather_heads(query, key, value, comm, 1, 2, type(module).__name__)
    saved = getattr(module, "num_key_value_groups", None)
    module.num_key_value_groups = split.groups[comm.rank]  # type: ignore[assignment]
    try:
        context, _ = local(module, q, k, v, None, **kwargs)
    finally:
        if saved is None:
            del module.num_key_value_groups
        else:
            module.num_key_value_groups = saved
    return to_sequence(context, comm, 2, 1, split.query, lengths), None
