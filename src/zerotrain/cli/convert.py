"""``zerotrain convert CKPT OUT --to deepspeed|dcp``: a zerotrain checkpoint as a DeepSpeed
universal checkpoint, which DeepSpeed loads at any world size and ZeRO stage 1-3 with
``"checkpoint": {"load_universal": true}``, or as a ``torch.distributed.checkpoint`` (DCP)
checkpoint in torchtitan's layout. The other direction needs no conversion:
``engine.load_checkpoint`` reads DeepSpeed checkpoints as they are."""

from __future__ import annotations

import argparse

from zerotrain.checkpoint.dcp_export import export_dcp
from zerotrain.checkpoint.deepspeed_export import export_deepspeed_universal
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``zerotrain convert``."""
    parser.add_argument("checkpoint", help="a zerotrain save directory, or one checkpoint")
    parser.add_argument("out", help="the directory to write (created if needed)")
    parser.add_argument(
        "--to",
        choices=["deepspeed", "dcp"],
        required=True,
        help="deepspeed: a universal checkpoint (weights, optimizer states, step counts, "
        "schedule, client state); dcp: PyTorch's distributed checkpoint (DCP) files (the model at "
        "the top level, torch's flattened optimizer state dict under 'optimizer')",
    )
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument(
        "--out-tag", default=None, help="tag to write (default: global_stepN_universal)"
    )


def run_convert(args: argparse.Namespace) -> int:
    """Write the converted checkpoint; returns the exit status (1 with a message when the
    checkpoint cannot be converted)."""
    try:
        if args.to == "dcp":
            path = export_dcp(args.checkpoint, args.out, args.tag)
            print(f"{path}: a PyTorch distributed checkpoint (DCP) directory")
            return 0
        path = export_deepspeed_universal(args.checkpoint, args.out, args.tag, args.out_tag)
    except CheckpointError as exc:
        log.error("%s", exc)
        return 1
    print(f'{path}: load it in DeepSpeed with "checkpoint": {{"load_universal": true}}')
    return 0
