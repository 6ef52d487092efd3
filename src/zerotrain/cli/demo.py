"""``zerotrain demo``: the main job, a byte-level GPT trained on 2 local ranks."""

from __future__ import annotations

import argparse

from zerotrain.cli import run as run_cmd


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zerotrain demo``."""
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (default 3)")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="compute dtype"
    )
    parser.add_argument("--out-dir", default="demo_out", help="where the plot and summary go")
    parser.add_argument(
        "--resume", action="store_true", help="continue from OUT_DIR/checkpoints/latest"
    )
    parser.add_argument(
        "--save-every", type=int, default=100, help="checkpoint every N steps (0: at the end)"
    )
    parser.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block in backward instead of storing its activations",
    )


def demo(args: argparse.Namespace) -> int:
    """Launch ``zerotrain.examples.train_gpt`` through ``zerotrain run``."""
    launch = run_cmd.local_launch(
        args.nproc,
        "zerotrain.examples.train_gpt",
        module=True,
        rdzv_id="zerotrain-demo",
        script_args=[
            "--steps",
            str(args.steps),
            "--stage",
            str(args.stage),
            "--precision",
            args.precision,
            "--out-dir",
            args.out_dir,
            "--save-every",
            str(args.save_every),
            *(["--resume"] if args.resume else []),
            *(["--checkpoint-activations"] if args.checkpoint_activations else []),
        ],
    )
    return run_cmd.run(launch)
