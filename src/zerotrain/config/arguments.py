"""DeepSpeed's command-line arguments: ``add_config_arguments(parser)``.

Scripts written for DeepSpeed call ``deepspeed.add_config_arguments(parser)`` and pass the
parsed ``args`` to ``initialize(args=args)``, which reads the config path from
``args.deepspeed_config``. The same group, with the same names and defaults, is added here.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` and return it.

    ``--deepspeed`` (a flag for the script's own use; no effect on the engine),
    ``--deepspeed_config PATH`` (the JSON config ``initialize(args=...)`` loads), and the
    deprecated ``--deepscale`` / ``--deepscale_config`` (read as the two above, with a
    warning).
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable DeepSpeed/zerotrain (a flag for the script; the engine does not read it)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed-format JSON config file"
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="deprecated: --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config"
    )
    return parser
