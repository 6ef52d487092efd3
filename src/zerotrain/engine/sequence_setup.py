"""Ulysses sequence parallelism at ``initialize``: routing the model's attention over the
sequence group.

Where the routing comes from, first match wins: attention the user already built with
``DistributedAttention``; the model's ``_sp_plan`` (attention cores by module name, the demo
GPT's); a ``transformers`` model's attention registry. Anything else is refused: running
attention on slices of a sequence without the exchange would train silently wrong (each
slice attending only to itself). The batch side is ``Engine.shard_sequence``.
"""

from __future__ import annotations

from torch import nn

from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.sequence import (
    DistributedAttention,
    apply_ulysses,
    model_sp_plan,
    wrap_transformers_attention,
)
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def route_attention(model: nn.Module, comm: Communicator) -> str:
    """Make ``model``'s attention run over ``comm`` (a sequence group of more than one
    rank); returns what was done, for the log.

    Raises:
        ValueError: nothing says where the model's attention is.
    """
    if any(isinstance(m, DistributedAttention) for m in model.modules()):
        return "the model's own DistributedAttention layers"
    plan = model_sp_plan(model)
    if plan is not None:
        applied = apply_ulysses(model, comm, plan)
        return f"{type(model).__name__}._sp_plan ({len(applied)} attention cores)"
    if getattr(getattr(model, "config", None), "_attn_implementation", None) is not None:
        name = wrap_transformers_attention(model, comm)
        return f"the transformers attention registry (as {name!r})"
    raise ValueError(
        f"sequence_parallel_size={comm.world_size}, but nothing says where "
        f"{type(model).__name__}'s attention is: build it with "
        "zerotrain.parallel.sequence.DistributedAttention, give the model an _sp_plan "
        "({module-name glob: 'bhsd' | 'bshd' | 'sbhd'} naming its attention cores), or use "
        "a transformers model (its attention is wrapped automatically)"
    )
