"""Sharded checkpoints: saved by every rank in parallel, loadable with any number of ranks at
any ZeRO stage, and consolidated into one file without holding the model in memory.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the entry points during training;
this package also offers :func:`load_state_dict_from_checkpoint` and :func:`consolidate` for
using a checkpoint without an engine. The format is described in ``docs/checkpoints.md``.
"""

from zerotrain.checkpoint.consolidate import (
    consolidate,
    iter_state_dict,
    load_state_dict_from_checkpoint,
)
from zerotrain.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from zerotrain.checkpoint.load import LoadReport
from zerotrain.checkpoint.reader import CheckpointReader

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "LoadReport",
    "consolidate",
    "iter_state_dict",
    "load_state_dict_from_checkpoint",
]
