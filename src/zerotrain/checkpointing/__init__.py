"""Activation checkpointing: trade recomputation in backward for activation memory.

- ``checkpoint(fn, *args, **kwargs)``: one region, called from model code.
- ``apply(model, block_types="auto")``: every block of a model, without editing it.
- ``configure(...)``: where kept inputs live, timing (the config's ``activation_checkpointing``
  section does this at ``initialize``); DeepSpeed's ``configure(mpu_, deepspeed_config, ...)``
  and ``is_configured()`` too; ``stats()`` reports what the regions did.

See docs/activation_checkpointing.md.
"""

from zerotrain.checkpointing.function import checkpoint
from zerotrain.checkpointing.state import (
    CheckpointingContext,
    configure,
    current,
    default_context,
    is_configured,
    reset,
    reset_stats,
    stats,
)
from zerotrain.checkpointing.stats import CheckpointStats
from zerotrain.checkpointing.wrap import apply, is_checkpointed, remove

__all__ = [
    "CheckpointStats",
    "CheckpointingContext",
    "apply",
    "checkpoint",
    "configure",
    "current",
    "default_context",
    "is_checkpointed",
    "is_configured",
    "remove",
    "reset",
    "reset_stats",
    "stats",
]
