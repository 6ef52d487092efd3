"""Ulysses sequence parallelism: attention, the split of a batch, and applying it to a model."""

from zerotrain.parallel.sequence.attention import (
    DistributedAttention,
    HeadSplit,
    balanced_sizes,
    split_heads,
)
from zerotrain.parallel.sequence.hf import wrap_transformers_attention
from zerotrain.parallel.sequence.plan import LAYOUTS, apply_ulysses, model_sp_plan
from zerotrain.parallel.sequence.shard import sequence_slice, shard_batch

__all__ = [
    "LAYOUTS",
    "DistributedAttention",
    "HeadSplit",
    "apply_ulysses",
    "balanced_sizes",
    "model_sp_plan",
    "sequence_slice",
    "shard_batch",
    "split_heads",
    "wrap_transformers_attention",
]
