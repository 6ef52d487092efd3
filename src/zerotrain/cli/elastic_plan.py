"""``zerotrain elastic-plan``: the global batch an ``elasticity`` config gives, the world
sizes that can train it, and how each splits it (DeepSpeed's ``ds_elastic``, with the split
of every valid world size added).

    zerotrain elastic-plan -c ds_config.json               # version 0.1
    zerotrain elastic-plan -c ds_config.json -w 16         # a world size (needed by 0.2)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zerotrain.config.elastic_batch import ElasticityError, micro_batch_for, plan_elastic_batch
from zerotrain.config.errors import ConfigError
from zerotrain.config.loader import load_config


def add_elastic_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zerotrain elastic-plan``."""
    parser.add_argument("-c", "--config", required=True, help="JSON config with 'elasticity'")
    parser.add_argument(
        "-w",
        "--world-size",
        type=int,
        default=0,
        help="the job's data-parallel world size (version 0.2 plans for it)",
    )


def run_elastic_plan(args: argparse.Namespace) -> int:
    """Print the plan; 2 on a config or world size that has none (with why)."""
    try:
        raw = json.loads(Path(args.config).read_text())
        section = load_config({"elasticity": raw.get("elasticity", {})}).elasticity
        if section is None or not section.enabled:
            raise ElasticityError(f"{args.config} has no enabled 'elasticity' section")
        opts = section.options()
        plan = plan_elastic_batch(opts, args.world_size)
    except (OSError, json.JSONDecodeError, ConfigError, ElasticityError) as err:
        print(f"zerotrain elastic-plan: {err}", file=sys.stderr)
        return 2
    print("elasticity:", json.dumps(raw["elasticity"], sort_keys=True))
    print(f"global batch (train_batch_size): {plan.train_batch_size}")
    print(f"valid data-parallel world sizes: {list(plan.valid_world_sizes)}")
    if plan.own_batch:
        print(
            f"note: world size {args.world_size} is not one the plan allows; this batch is "
            "its own (version 0.2), other world sizes would get another"
        )
    print()
    print("world size | micro-batch | accumulation steps")
    for world in plan.valid_world_sizes:
        micro = micro_batch_for(plan.train_batch_size, world, opts)
        gas = plan.train_batch_size // (micro * world)
        mark = "  <- this job" if world == args.world_size else ""
        print(f"{world:>10} | {micro:>11} | {gas:>18}{mark}")
    return 0
