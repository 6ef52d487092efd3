"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``, for zerotrain checkpoints: fp32 weights out
of a sharded checkpoint, in memory or as ``pytorch_model.bin`` / ``model.safetensors`` files
(sharded with a Hugging Face index past ``max_shard_size``)::

    from zerotrain.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint("ckpt"))

    python -m zerotrain.utils.zero_to_fp32 ckpt out/ [--tag T] [--safe_serialization]
        [--max_shard_size 5GB] [--exclude_frozen_parameters]

It reads zerotrain's checkpoint format, not DeepSpeed's (``docs/checkpoints.md``,
"zero_to_fp32", lists what differs). The implementation is
``zerotrain/checkpoint/fp32_export.py``; this module only gives it DeepSpeed's import path
and script, and nothing inside zerotrain imports it (tests/unit/test_layer_rules.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.fp32_export import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    parse_shard_size,
)
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)

__all__ = [
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zerotrain.utils.zero_to_fp32",
        description="Write the fp32 weights of a zerotrain checkpoint into OUTPUT_DIR as "
        "pytorch_model.bin or model.safetensors (sharded, with an index, past max_shard_size).",
    )
    parser.add_argument(
        "checkpoint_dir", help="the directory given to engine.save_checkpoint (or one checkpoint)"
    )
    parser.add_argument("output_dir", help="directory for the fp32 weight files")
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="largest file before the weights are split into shards: bytes, or digits "
        "followed by KB, MB, GB or TB (decimal; default 5GB)",
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write safetensors files instead of torch.save (pickle) files",
    )
    parser.add_argument(
        "-t", "--tag", default=None, help="checkpoint tag, e.g. global_step14 (default: latest)"
    )
    parser.add_argument(
        "--exclude_frozen_parameters",
        action="store_true",
        help="leave out parameters saved with requires_grad=False",
    )
    parser.add_argument("-d", "--debug", action="store_true", help="log at DEBUG level")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The script: returns the exit status (1, with the message logged, for a checkpoint
    that cannot be read; 2 from argparse for bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        parse_shard_size(args.max_shard_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.debug:
        logging.getLogger("zerotrain").setLevel(logging.DEBUG)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except CheckpointError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
