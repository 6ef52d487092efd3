"""Ulysses sequence parallelism at ``initialize``: routing the model's attention over the
sequence group.

Where the routing comes from, first match wins: attention the user already built with
``DistributedAttention``; the model's ``_sp_plan`` (attention cores by module name, the demo
GPT's); a ``transformers`` model's attention registry. Anything else is refused: running
attention on slices of a sequence without the exchange would train silently wrong (each
slice attending only to itself). The batch side is ``Engine.shard_sequence``.

Random streams: the ranks of a sequence group hold different positions (and, inside
attention, different heads), so their dropout masks must be independent, where a job
seeded alike on every rank would draw the same mask for each rank's slice.
:func:`distinct_random_streams` reseeds sequence ranks above 0 from the job's seed plus an
offset per sequence rank (tensor ranks at one sequence coordinate stay alike, as tensor
parallelism needs), and :func:`sequence_seed_offset` offsets tensor parallelism's per-rank
streams the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.comm.buckets import broadcast_tensors
from zerotrain.comm.collectives import Communicator
from zerotrain.parallel.groups import ProcessGroups
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


# A prime well above any tensor degree: sequence rank r's streams start r of these away.
_SEQUENCE_SEED_STRIDE = 1_000_003


def sequence_seed_offset(groups: ProcessGroups) -> int:
    """What this rank's sequence coordinate adds to the job's seed (0 on sequence rank 0,
    so a job without Ulysses draws exactly as before)."""
    return _SEQUENCE_SEED_STRIDE * groups.sequence.rank


def job_seed(groups: ProcessGroups, device: torch.device) -> int:
    """The job's seed: world rank 0's initial seed, on every rank (collective)."""
    seed = torch.tensor([torch.initial_seed() % (2**31)], dtype=torch.int64, device=device)
    broadcast_tensors(groups.world, [seed], 1, src=0)
    return int(seed.item())


def distinct_random_streams(groups: ProcessGroups, device: torch.device) -> None:
    """Reseed the default generators of sequence ranks above 0 from the job's seed plus
    their offset; sequence rank 0 keeps its state."""
    seed = job_seed(groups, device)
    if groups.sequence.rank > 0:
        torch.manual_seed(seed + sequence_seed_offset(groups))
