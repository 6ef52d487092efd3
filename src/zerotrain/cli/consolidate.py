"""``zerotrain consolidate CKPT_DIR OUT.safetensors``: one full state dict from a sharded
checkpoint, streamed one tensor at a time."""

from __future__ import annotations

import argparse

import torch

from zerotrain.checkpoint.consolidate import consolidate
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``zerotrain consolidate``."""
    parser.add_argument(
        "checkpoint", help="a save directory (its latest checkpoint) or one checkpoint"
    )
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="cast floating-point tensors (default: each tensor's own dtype in the model; "
        "parameters take their fp32 master values where saved)",
    )


def run_consolidate(args: argparse.Namespace) -> int:
    """Write the file; returns the exit status (1 with a message for a bad checkpoint)."""
    try:
        consolidate(args.checkpoint, args.out, args.tag, _DTYPES.get(args.dtype))
    except CheckpointError as exc:
        log.error("%s", exc)
        return 1
    return 0
