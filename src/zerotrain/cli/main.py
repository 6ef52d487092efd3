"""The ``zerotrain`` command: ``run`` launches a job, ``demo`` trains the example GPT,
``consolidate`` turns a sharded checkpoint into one safetensors file, ``convert`` writes it
as a DeepSpeed universal or a torch DCP checkpoint, ``estimate`` predicts
per-rank memory of a ZeRO configuration, ``lr-find`` runs an LR range test on a script,
``elastic-plan`` prints the batch plan of an ``elasticity`` config."""

from __future__ import annotations

import argparse
import sys

from zerotrain.cli import consolidate as consolidate_cmd
from zerotrain.cli import convert as convert_cmd
from zerotrain.cli import demo as demo_cmd
from zerotrain.cli import elastic_plan as elastic_plan_cmd
from zerotrain.cli import estimate as estimate_cmd
from zerotrain.cli import lr_find as lr_find_cmd
from zerotrain.cli import run as run_cmd


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="zerotrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_cmd.add_run_arguments(
        sub.add_parser("run", help="launch a training script on N processes (via torchrun)")
    )
    demo_cmd.add_demo_arguments(
        sub.add_parser("demo", help="train a small byte-level GPT on 2 local ranks")
    )
    consolidate_cmd.add_consolidate_arguments(
        sub.add_parser(
            "consolidate", help="write a sharded checkpoint's full state dict to one file"
        )
    )
    convert_cmd.add_convert_arguments(
        sub.add_parser(
            "convert", help="write a checkpoint as a DeepSpeed universal or a torch DCP one"
        )
    )
    estimate_cmd.add_estimate_arguments(
        sub.add_parser(
            "estimate",
            help="per-rank memory of a ZeRO configuration and the largest model that fits",
        )
    )
    lr_find_cmd.add_lr_find_arguments(
        sub.add_parser(
            "lr-find",
            help="LR range test: train a script with a rising lr, plot it, suggest a range",
        )
    )
    elastic_plan_cmd.add_elastic_plan_arguments(
        sub.add_parser(
            "elastic-plan",
            help="the global batch of an elasticity config and how each world size splits it",
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zerotrain`` console script."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        return run_cmd.run(args)
    if args.command == "convert":
        return convert_cmd.run_convert(args)
    if args.command == "consolidate":
        return consolidate_cmd.run_consolidate(args)
    if args.command == "estimate":
        return estimate_cmd.run_estimate(args)
    if args.command == "lr-find":
        return lr_find_cmd.run_lr_find(args)
    if args.command == "elastic-plan":
        return elastic_plan_cmd.run_elastic_plan(args)
    return demo_cmd.demo(args)


if __name__ == "__main__":
    sys.exit(main())
